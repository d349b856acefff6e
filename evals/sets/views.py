"""Console pages of eval sets: the sets with their latest version and score, one set with its versions
and each one's first cases, and for operators the forms that add a set and upload a version. Both go
through the API's services, so the console refuses what /api/v1/evalsets/ refuses, every bad line named."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import JSONField, OuterRef, Q, Subquery
from django.db.models.expressions import RawSQL
from django.shortcuts import get_object_or_404, redirect, render
from django.template import TemplateDoesNotExist
from django.template.loader import get_template

from evals.choices import RunStatus
from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.sets import jsonl, services
from evals.sets.forms import EvalSetForm, UploadForm
from inferops.console import console_action
from inferops.forms import apply_service
from inferops.models import AuditEvent
from inferops.roles import OPERATOR

PREVIEW_CASES = 5
SHOWN_VERSIONS = 20
SHOWN_RUNS = 20
# The runs' own section of a set's page (evals/runs); the page shows it once that template exists.
RUNS_TEMPLATE = "evals/set_runs.html"


def set_rows():
    """Every set with its latest version and its last succeeded run, one query."""
    latest = EvalSetVersion.objects.filter(eval_set=OuterRef("pk")).order_by("-number")
    last_run = EvalRun.objects.filter(eval_set=OuterRef("pk"), status=RunStatus.SUCCEEDED).order_by(
        "-finished_at", "-id")
    return EvalSet.objects.annotate(
        latest_number=Subquery(latest.values("number")[:1]),
        latest_cases=Subquery(latest.values("case_count")[:1]),
        last_run_id=Subquery(last_run.values("pk")[:1]),
        last_score=Subquery(last_run.values("score")[:1]),
        last_model=Subquery(last_run.values("model_version__model__name")[:1]),
        last_model_version=Subquery(last_run.values("model_version__number")[:1]),
    ).order_by("name")


@login_required
def set_list(request):
    return render_list(request)


def render_list(request, *, form=None, status=200):
    return render(request, "evals/set_list.html", {"sets": set_rows(), "form": form or EvalSetForm()},
                  status=status)


@console_action(OPERATOR, "Adding an eval set")
def set_new(request):
    form = EvalSetForm(request.POST)
    if form.is_valid() and (created := apply_service(
            form, lambda: services.evalset_create(actor=request.user, **form.cleaned_data))):
        messages.success(request, f"Eval set {created.name} added: upload its cases as JSONL.")
        return redirect("evals:set-detail", name=created.name)
    return render_list(request, form=form, status=400)


def versions_with_preview(eval_set: EvalSet):
    # The first cases are cut in Postgres: a version may hold thousands.
    preview = RawSQL(f"jsonb_path_query_array(\"evals_evalsetversion\".\"items\", '$[0 to {PREVIEW_CASES - 1}]')",
                     [], output_field=JSONField())
    return (eval_set.versions.select_related("created_by").defer("content", "items")
            .annotate(preview=preview).order_by("-number")[:SHOWN_VERSIONS])


def runs_template() -> str | None:
    try:
        get_template(RUNS_TEMPLATE)
    except TemplateDoesNotExist:
        return None
    return RUNS_TEMPLATE


def render_detail(request, eval_set: EvalSet, *, upload_form=None, line_errors=(), status=200):
    versions = list(versions_with_preview(eval_set))
    for version in versions:
        version.more_cases = version.case_count - len(version.preview or [])
    version_ids = [str(pk) for pk in eval_set.versions.values_list("pk", flat=True)]
    audit = AuditEvent.objects.filter(Q(object_type="evals.evalset", object_id=str(eval_set.pk))
                                      | Q(object_type="evals.evalsetversion", object_id__in=version_ids))
    return render(request, "evals/set_detail.html", {
        "eval_set": eval_set, "versions": versions, "version_count": len(version_ids),
        "upload_form": upload_form or UploadForm(), "line_errors": line_errors,
        "max_bytes": settings.INFEROPS_EVALSET_MAX_BYTES, "max_cases": settings.INFEROPS_EVALSET_MAX_CASES,
        "runs": eval_set.runs.select_related("model_version__model", "set_version")[:SHOWN_RUNS],
        "runs_template": runs_template(), "audit": audit[:50],
    }, status=status)


@login_required
def set_detail(request, name: str):
    eval_set = get_object_or_404(EvalSet.objects.prefetch_related("default_for"), name=name)
    return render_detail(request, eval_set)


def upload_version(form: UploadForm, eval_set: EvalSet, actor) -> tuple[EvalSetVersion | None, list[dict]]:
    """The service on the form's file; (the version, []) or (None, the bad lines) with the reason on the form."""
    upload = form.cleaned_data["file"]
    try:
        if upload.size > settings.INFEROPS_EVALSET_MAX_BYTES:
            raise jsonl.too_large(settings.INFEROPS_EVALSET_MAX_BYTES)
        return services.version_upload(eval_set=eval_set, raw=upload.read(), actor=actor), []
    except jsonl.FileTooLarge as exc:
        form.add_error("file", str(exc))
    except jsonl.BadFile as exc:
        form.add_error("file", f"{upload.name} is refused and nothing was stored: "
                               f"{len(exc.errors)} problem{'s' if len(exc.errors) != 1 else ''} below.")
        return None, exc.errors
    return None, []


@console_action(OPERATOR, "Uploading an eval set version")
def version_new(request, name: str):
    eval_set = get_object_or_404(EvalSet.objects.prefetch_related("default_for"), name=name)
    form = UploadForm(request.POST, request.FILES)
    line_errors: list[dict] = []
    if form.is_valid():
        version, line_errors = upload_version(form, eval_set, request.user)
        if version is not None:
            messages.success(request, f"Uploaded {eval_set.name} v{version.number}: {version.case_count} cases, "
                                      f"sha256 {version.sha256[:12]}…")
            return redirect("evals:set-detail", name=eval_set.name)
    return render_detail(request, eval_set, upload_form=form, line_errors=line_errors, status=400)


# The middleware lets an upload's body past the usual limit (inferops.middleware.body_limit).
version_new.max_body_bytes = services.upload_body_limit
