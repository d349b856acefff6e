"""Console pages of the registry: models, their versions and aliases, and for operators the forms
that register a version and move an alias. Each form's input goes through the API's serializer,
then the service, so the console refuses what `/api/v1/models/` refuses."""

import re

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from inferops.models import AuditEvent
from inferops.panels import version_panels
from inferops.roles import require_operator
from inferops.validators import slug_validator
from registry import services
from registry.api import AliasSetSerializer, VersionCreateSerializer, model_queryset
from registry.checkpoint import CheckpointError
from registry.choices import Task
from registry.models import ModelVersion


@login_required
def model_list(request):
    search = request.GET.get("q", "").strip()
    task = request.GET.get("task", "")
    models = model_queryset()
    if search:
        models = models.filter(
            Q(name__icontains=search) | Q(description__icontains=search)
            | Q(owner__icontains=search) | Q(tags__contains=[search])
        )
    if task in Task.values:
        models = models.filter(task=task)
    page = Paginator(models, 50).get_page(request.GET.get("page"))
    return render(request, "registry/model_list.html", {
        "page": page, "search": search, "task": task, "tasks": Task.choices,
    })


class VersionForm(forms.Form):
    artifact_uri = forms.CharField(
        label="Artifact URI", max_length=1024, widget=forms.TextInput(attrs={"size": 60, "class": "mono"}),
        help_text="a directory the workers can read, or its file:// URI: /models/llama-3b or file:///models/llama-3b")
    sha256 = forms.CharField(label="Expected digest", required=False, max_length=64,
                             widget=forms.TextInput(attrs={"size": 66, "class": "mono"}),
                             help_text="optional: the manifest sha256 CI computed; registering fails if it differs")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}))


class AliasForm(forms.Form):
    alias = forms.CharField(label="Alias", max_length=63, help_text="e.g. champion, canary")
    version = forms.TypedChoiceField(coerce=int, label="Version")

    def __init__(self, *args, model, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["version"].choices = [(v.number, f"v{v.number}") for v in model.versions.order_by("-number")]

    def clean_alias(self) -> str:
        alias = self.cleaned_data["alias"].strip()
        try:
            slug_validator(alias)
        except ValidationError:
            raise ValidationError(f"{alias!r} is not a valid alias: {slug_validator.message}") from None
        return alias


# The API's field names, as a person reads them on the form.
FIELD_WORDS = {"artifact_uri": "artifact URI", "sha256": "expected digest"}


def readable(text: str) -> str:
    for field, words in FIELD_WORDS.items():
        text = re.sub(rf"\b{field}\b", words, text)
    return text[:1].upper() + text[1:]


def add_serializer_errors(form: forms.Form, errors: dict) -> None:
    for field, texts in errors.items():
        for text in texts:
            form.add_error(field if field in form.fields else None, readable(str(text)))


def register_version(form: VersionForm, model, actor):
    """The API's serializer, then the service; a checkpoint that cannot be registered puts its
    reason beside the field at fault and stores nothing."""
    body = {key: value for key, value in form.cleaned_data.items() if key != "sha256" or value}
    serializer = VersionCreateSerializer(data=body)
    if not serializer.is_valid():
        add_serializer_errors(form, serializer.errors)
        return None
    data = serializer.validated_data
    try:
        return services.version_register(model=model, artifact_uri=data["artifact_uri"], actor=actor,
                                         expected_sha256=data.get("sha256"), description=data["description"])
    except CheckpointError as exc:
        form.add_error(exc.field if exc.field in form.fields else "artifact_uri", readable(str(exc)))
    return None


@login_required
def model_detail(request, name: str):
    return render_model(request, get_object_or_404(model_queryset(), name=name))


def render_model(request, model, *, version_form=None, alias_form=None, status=200):
    versions = model.versions.prefetch_related("aliases").order_by("-number")
    version_ids = [str(v.pk) for v in versions]
    alias_ids = [str(a.pk) for a in model.aliases.all()]
    audit = AuditEvent.objects.filter(
        Q(object_type="registry.registeredmodel", object_id=str(model.pk))
        | Q(object_type="registry.modelversion", object_id__in=version_ids)
        | Q(object_type="registry.alias", object_id__in=alias_ids)
        | Q(object_type="registry.alias", before__model=model.pk)
    )[:100]
    latest = versions[0] if versions else None
    return render(request, "registry/model_detail.html", {
        "model": model, "versions": versions, "aliases": model.aliases.all(), "audit": audit,
        "version_form": version_form or VersionForm(), "alias_form": alias_form or AliasForm(model=model),
        # The newest version's panels (its eval scores against its parent's): what a person asks first.
        "latest": latest, "latest_panels": version_panels.render(request, latest) if latest else [],
    }, status=status)


@login_required
def version_detail(request, name: str, number: int):
    """One version: its serving facts, its aliases, and what other apps add (inferops.panels.version_panels)."""
    version = get_object_or_404(ModelVersion.objects.select_related("model").prefetch_related("aliases"),
                                model__name=name, number=number)
    audit = AuditEvent.objects.filter(object_type="registry.modelversion", object_id=str(version.pk))[:100]
    return render(request, "registry/version_detail.html", {
        "model": version.model, "version": version, "panels": version_panels.render(request, version), "audit": audit,
    })


@login_required
@require_POST
def version_new(request, name: str):
    require_operator(request, "Registering a version")
    model = get_object_or_404(model_queryset(), name=name)
    form = VersionForm(request.POST)
    if form.is_valid() and (version := register_version(form, model, request.user)) is not None:
        messages.success(request, f"Registered {model.name} v{version.number} ({version.architecture}, "
                                  f"digest {version.digest[:12]}…).")
        return redirect("registry:model-detail", name=model.name)
    return render_model(request, model, version_form=form, status=400)


@login_required
@require_POST
def alias_move(request, name: str):
    require_operator(request, "Moving an alias")
    model = get_object_or_404(model_queryset(), name=name)
    form = AliasForm(request.POST, model=model)
    if form.is_valid():
        serializer = AliasSetSerializer(data={"version": form.cleaned_data["version"]})
        if serializer.is_valid():
            version = model.versions.get(number=serializer.validated_data["version"])
            alias, previous = services.alias_set(model=model, name=form.cleaned_data["alias"], version=version,
                                                 actor=request.user)
            moved = f" (was v{previous.number})" if previous else " (new alias)"
            messages.success(request, f"Alias {alias.name} now points at v{version.number}{moved}.")
            return redirect("registry:model-detail", name=model.name)
        add_serializer_errors(form, serializer.errors)
    return render_model(request, model, alias_form=form, status=400)
