"""The deployment create and edit forms of the console, and the diff a person confirms."""

import hashlib
import json
import re

from django import forms
from django.core.exceptions import ValidationError

from deployments import services
from deployments.api import (
    DeploymentCreateSerializer,
    DeploymentUpdateSerializer,
    deployment_queryset,
)
from deployments.choices import Backend, DriverName
from inferops.api import Conflict
from inferops.forms import serializer_check
from registry.models import RegisteredModel


class JSONObjectField(forms.CharField):
    widget = forms.Textarea(attrs={"rows": 3, "cols": 50, "class": "mono"})

    def to_python(self, value):
        value = (value or "").strip()
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg}.") from None
        if not isinstance(parsed, dict):
            raise ValidationError('Must be a JSON object, e.g. {"max_num_seqs": 64}.')
        return parsed

    def prepare_value(self, value):
        return json.dumps(value) if isinstance(value, dict) else value


# The API's field names in service messages, as the form's labels say them.
FIELD_WORDS = {"min_replicas": "minimum replicas", "max_replicas": "maximum replicas", "gpu_count": "GPU count",
               "gpu_type": "GPU type", "engine_args": "engine arguments", "replicas": "replicas"}
RESOURCE_FIELDS = ("cpu", "memory", "gpu_type", "gpu_count")
# Errors on API fields the form asks for through another field.
FORM_FIELD = {"model": "version", "alias": "version", "engine_args": "engine_args"}
# The API fields a form field stands for: when the form refuses it, the API's checks skip those.
API_FIELDS = {"version": ("model", "version", "alias"), **{key: ("resources",) for key in RESOURCE_FIELDS}}


def readable(text: str) -> str:
    if re.match(r"\w+: ", text):  # "<engine key>: reason": the key as the engine spells it
        return text
    for field, words in FIELD_WORDS.items():
        text = re.sub(rf"\b{field}\b", words, text)
    return text[:1].upper() + text[1:]


def version_choices(models) -> list:
    """Per model, its versions (with the aliases on each), then its aliases: "<model>:<number>" pins a
    number, "<model>@<alias>" the version the alias names now."""
    groups = []
    for model in models:
        on_version: dict[int, list[str]] = {}
        for alias in model.aliases.all():
            on_version.setdefault(alias.version_id, []).append(alias.name)
        options = []
        for version in sorted(model.versions.all(), key=lambda v: -v.number):
            label = f"{model.name} v{version.number}"
            if version.pk in on_version:
                label += f" ({', '.join(sorted(on_version[version.pk]))})"
            if version.status != "ready":
                label += f" · {version.status}"
            options.append((f"{model.name}:{version.number}", label))
        options += [(f"{model.name}@{alias.name}", f"{model.name} @{alias.name} (now v{alias.version.number})")
                    for alias in sorted(model.aliases.all(), key=lambda a: a.name)]
        if options:
            groups.append((model.name, options))
    return groups


def parse_version_choice(value: str) -> tuple[str, int | None, str | None]:
    """(model name, version number or None, alias or None) of a version_choices value."""
    if "@" in value:
        model, alias = value.split("@", 1)
        return model, None, alias
    model, number = value.rsplit(":", 1)
    return model, int(number), None


def cpu_value(text: str):
    """Cores as a number when typed as one (2, 0.5), else the quantity as typed ("500m")."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class DeploymentFields(forms.Form):
    """The fields a deployment's create and edit forms share, in the API's names."""

    replicas = forms.IntegerField(min_value=0, max_value=256, initial=1)
    autoscale = forms.BooleanField(required=False, help_text="let the autoscaler move replicas between the bounds")
    min_replicas = forms.IntegerField(min_value=0, max_value=256, required=False, label="Minimum replicas",
                                      help_text="empty: the replicas")
    max_replicas = forms.IntegerField(min_value=0, max_value=256, required=False, label="Maximum replicas",
                                      help_text="empty: the replicas")
    cpu = forms.CharField(required=False, max_length=32, label="CPU", help_text='cores per replica: 2, 0.5 or "500m"')
    memory = forms.CharField(required=False, max_length=32, help_text='per replica, e.g. "16Gi"')
    gpu_type = forms.CharField(required=False, max_length=64, label="GPU type", help_text="e.g. nvidia-h100")
    gpu_count = forms.IntegerField(required=False, min_value=0, max_value=64, label="GPU count",
                                   help_text="GPUs per replica")
    engine_args = JSONObjectField(required=False, label="Engine arguments", help_text='e.g. {"max_num_seqs": 64}')
    SECTIONS = [("Model", ("name", "version", "backend", "driver")),
                ("Replicas", ("replicas", "autoscale", "min_replicas", "max_replicas", "paused")),
                ("Resources (per replica)", RESOURCE_FIELDS), ("Engine", ("engine_args",))]

    def sections(self) -> list[tuple[str, list]]:
        return [(title, [self[name] for name in names if name in self.fields]) for title, names in self.SECTIONS]

    def refused(self) -> set[str]:
        """The API fields behind the fields the form holds errors on."""
        return {api for field in self.errors for api in API_FIELDS.get(field, (field,))}

    def resources(self) -> dict | None:
        """The resources typed, in the API's shape; None when one of their fields was refused."""
        data = self.cleaned_data
        if any(key not in data for key in RESOURCE_FIELDS):
            return None
        found = {key: data[key].strip() if isinstance(data[key], str) else data[key] for key in RESOURCE_FIELDS}
        if found["cpu"]:
            found["cpu"] = cpu_value(found["cpu"])
        return {key: value for key, value in found.items() if value not in ("", None)}

    def add_api_errors(self, errors: dict) -> None:
        """Errors keyed by API field (the serializer's or the service's) beside the form's field, in words."""
        for key, texts in errors.items():
            for text in texts:
                text, field = str(text), FORM_FIELD.get(key, key)
                if key == "resources" and (match := re.match(r"(\w+): (.*)", text)) and match[1] in self.fields:
                    field, text = match[1], match[2]
                self.add_error(field if field in self.fields else None, readable(text))

    def write(self, call):
        """Run a service; its refusal goes beside the fields. Its result, or None when it refused."""
        try:
            return call()
        except ValidationError as exc:
            self.add_api_errors(exc.message_dict)
        except Conflict as exc:
            self.add_error("name" if "name" in self.fields else None, str(exc.detail))
        return None


class DeploymentForm(DeploymentFields):
    name = forms.CharField(max_length=63, help_text="the route clients call: lowercase letters, digits and dashes")
    version = forms.ChoiceField(label="Model version", help_text="an alias pins the version it names now")
    backend = forms.ChoiceField(choices=Backend.choices)
    driver = forms.ChoiceField(choices=DriverName.choices)
    field_order = ["name", "version", "backend", "driver"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["version"].choices = [("", "choose a version")] + version_choices(
            RegisteredModel.objects.prefetch_related("versions", "aliases__version").order_by("name"))

    def api_body(self) -> dict:
        """What the form read, in the API's names; a field it refused is left out."""
        data = self.cleaned_data
        body = {key: data[key] for key in ("backend", "driver", "replicas", "autoscale", "engine_args",
                                           "min_replicas", "max_replicas") if data.get(key) is not None}
        if "name" in data:
            body["name"] = data["name"].strip()
        if "version" in data:
            model, number, alias = parse_version_choice(data["version"])
            body.update({"model": model, "version": number} if number is not None else {"model": model, "alias": alias})
        if (resources := self.resources()) is not None:
            body["resources"] = resources
        return body

    def create(self, actor):
        """Every check in one pass (the form's, the API serializer's, the service's), each error beside
        its field; the deployment, written only when nothing was refused (else None)."""
        self.is_valid()
        data, errors = serializer_check(DeploymentCreateSerializer, self.api_body(), refused=self.refused())
        self.add_api_errors(errors)
        if self.errors:  # the service judges what was read, and writes nothing
            self.write(lambda: services.deployment_build(**data, refused=self.refused() | set(errors)))
            return None
        return self.write(lambda: services.deployment_create(actor=actor, **data))


class DeploymentEditForm(DeploymentFields):
    version = forms.ChoiceField(label="Model version")
    paused = forms.BooleanField(required=False, help_text="Pause reconciliation")
    field_order = ["version"]

    def __init__(self, deployment, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deployment = deployment
        self.fields["version"].choices = version_choices([deployment.model])

    def changes(self) -> dict:
        """What differs from the deployment, in the API's names (a PATCH body); a refused field is left out."""
        data, deployment, changes = self.cleaned_data, self.deployment, {}
        if "version" in data:
            _, number, alias = parse_version_choice(data["version"])
            changes = {"alias": alias} if alias else {"version": number} if number != deployment.version.number else {}
        for key in ("replicas", "autoscale", "paused", "engine_args", "min_replicas", "max_replicas"):
            if data.get(key) is not None and data[key] != getattr(deployment, key):
                changes[key] = data[key]
        if (resources := self.resources()) is not None and resources != deployment.resources:
            changes["resources"] = resources
        return changes

    def review(self) -> dict:
        """The changes as the API reads them, after every check in one pass (the form's, the API
        serializer's, the service's on a copy of the deployment), each error beside its field."""
        self.is_valid()
        data, errors = serializer_check(DeploymentUpdateSerializer, self.changes(), refused=self.refused())
        self.add_api_errors(errors)
        copy = deployment_queryset().get(pk=self.deployment.pk)  # the service sets the changes on it
        self.write(lambda: services.apply_changes(copy, **data, refused=self.refused() | set(errors)))
        return data


def edit_initial(deployment) -> dict:
    return {"version": f"{deployment.model.name}:{deployment.version.number}", "replicas": deployment.replicas,
            "autoscale": deployment.autoscale, "min_replicas": deployment.min_replicas,
            "max_replicas": deployment.max_replicas, "paused": deployment.paused,
            "engine_args": deployment.engine_args,
            **{key: deployment.resources.get(key, "") for key in RESOURCE_FIELDS}}


def value_text(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ", ".join(f"{key}={item}" for key, item in value.items()) or "none"
    return str(value)


def change_rows(deployment, changes: dict) -> list[dict]:
    """The diff a person confirms: each field that changes, before → after."""
    rows = []
    if "version" in changes or "alias" in changes:
        target = (deployment.model.aliases.select_related("version").get(name=changes["alias"]).version.number
                  if "alias" in changes else changes["version"])
        rows.append({"field": "Model version", "before": f"v{deployment.version.number}",
                     "after": f"v{target}" + (f" (alias {changes['alias']})" if "alias" in changes else "")})
    labels = {"replicas": "Replicas", "autoscale": "Autoscaling", "paused": "Reconciliation paused",
              "min_replicas": "Minimum replicas", "max_replicas": "Maximum replicas",
              "engine_args": "Engine arguments", "resources": "Resources"}
    rows += [{"field": label, "before": value_text(getattr(deployment, key)), "after": value_text(changes[key])}
             for key, label in labels.items() if key in changes]
    return rows


def changes_token(deployment, changes: dict) -> str:
    """Names one diff of one state: a confirmation applies only the diff it was shown, and a
    deployment changed meanwhile (or a form edited after review) is shown its new diff."""
    state = {"changes": changes, "updated_at": deployment.updated_at.isoformat()}
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:32]
