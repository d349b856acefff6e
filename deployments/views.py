
from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache

from deployments import services
from deployments.api import (
    SERIES_UNITS,
    DeploymentSerializer,
    deployment_queryset,
)
from deployments.choices import ACTIVE_ROLLOUT, ReplicaState
from deployments.forms import DeploymentEditForm, DeploymentForm, change_rows, changes_token, edit_initial
from deployments.panels import render_panels
from deployments.replicas import cold_start
from deployments.replicas.drivers import driver_for
from deployments.replicas.metrics_query import gpu_telemetry_summary, mfu_summary, slo_scheduling_summary
from deployments.rollouts.forms import RolloutForm, undo_offer
from inferops.roles import require_operator

CHARTS = [
    ("requests_per_s", "Requests/s"), ("output_tokens_per_s", "Output tokens/s"),
    ("ttft", "TTFT p50 / p95 / p99 (ms)"), ("itl_p95", "ITL p95 (ms)"), ("queue_depth", "Queue depth"),
    # KV-cache usage beside GPU utilisation (the grid has two columns: the error rate comes first).
    ("kv_cache_usage", "KV-cache usage"),
    ("gpu_utilization", "GPU utilisation (mean over the replicas' GPUs)"),
    ("gpu_memory", "GPU memory used / total (MiB, all the replicas' GPUs)"),
    ("mfu", "Model FLOPs utilisation (estimated)"),
    ("slo_scheduling", "SLO scheduling: requests judged, deadlines missed, refused or served late (/s)"),
]
GPU_CHARTS = {"gpu_utilization", "gpu_memory"}
# The page's time ranges (its select): the MFU figure under its chart covers the one the page was loaded with.
RANGES = {"15m": (900, "15 minutes"), "1h": (3600, "hour"), "6h": (21600, "6 hours"), "1d": (86400, "day"),
          "7d": (604800, "7 days")}


@never_cache  # it refreshes itself (partials/live.html): every fetch must reach the database
@login_required
def deployment_list(request):
    from deployments.overview import deployment_health

    rows = deployment_health()  # every deployment, by name
    return render(request, "deployments/list.html", {"rows": rows})


@login_required
def deployment_create(request):
    require_operator(request, "Changing deployments")
    # Not `request.POST or None`: an empty POST is still a submission, refused field by field.
    form = DeploymentForm(request.POST if request.method == "POST" else None)
    if request.method == "POST":
        if created := form.create(request.user):
            messages.success(request, f"Deployment {created.name} created: v{created.version.number} "
                                      f"on {created.replicas} replica(s).")
            return redirect("deployments:detail", name=created.name)
        return render(request, "deployments/form.html", {"form": form, "title": "New deployment"}, status=400)
    return render(request, "deployments/form.html", {"form": form, "title": "New deployment"})


@login_required
def deployment_edit(request, name: str):
    """Scale, change version, autoscaling, resources or engine arguments: the change is shown as a
    diff and applied once the person confirms that diff."""
    require_operator(request, "Changing deployments")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    form = DeploymentEditForm(deployment, request.POST if request.method == "POST" else None,
                              initial=edit_initial(deployment))
    context = {"form": form, "title": f"Change {name}", "deployment": deployment}
    if request.method != "POST":
        return render(request, "deployments/form.html", context)
    validated = form.review()
    if form.errors:
        return render(request, "deployments/form.html", context, status=400)
    changes = form.changes()
    if not changes:
        form.add_error(None, f"Nothing to change: every value is what {name} has now.")
        return render(request, "deployments/form.html", context, status=400)
    token = changes_token(deployment, changes)
    if request.POST.get("confirm") != token:
        return render(request, "deployments/form.html", {**context, "diff": change_rows(deployment, changes),
                                                         "diff_token": token})
    updated = form.write(lambda: services.deployment_update(deployment=deployment, actor=request.user,
                                                            **validated))
    if updated is None:
        return render(request, "deployments/form.html", context, status=400)
    messages.success(request, f"{name} changed: " + "; ".join(
        f"{row['field'].lower()} {row['before']} → {row['after']}" for row in change_rows(deployment, changes)) + ".")
    return redirect("deployments:detail", name=name)


@login_required
def deployment_detail(request, name: str):
    return render_detail(request, get_object_or_404(deployment_queryset(), name=name))


def render_detail(request, deployment, *, rollout_form=None, status=200):
    show_all = request.GET.get("replicas") == "all"
    replicas = deployment.replica_set.select_related("version").order_by("-id")
    if not show_all:
        replicas = replicas.exclude(state=ReplicaState.STOPPED)
    driver = driver_for(deployment.driver)
    rows = [{"replica": r, "log": driver.log_tail(r, lines=20)} for r in replicas[:50]]
    history = list(deployment.rollouts.select_related("stable_version", "candidate_version").order_by("-id")[:20])
    active = next((r for r in history if r.status in ACTIVE_ROLLOUT), None)
    if active is None:  # older than the last 20: the constraint allows one
        active = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
    span = request.GET.get("range") if request.GET.get("range") in RANGES else "1h"
    gpu = gpu_telemetry_summary(deployment)
    charts = [chart for chart in CHARTS if gpu["measured"] or chart[0] not in GPU_CHARTS]
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "summary": DeploymentSerializer(deployment).data, "replicas": rows,
        "show_all": show_all, "charts": charts, "units": SERIES_UNITS,
        "range": span, "range_options": [(key, words) for key, (_, words) in RANGES.items()],
        "gpu": gpu, "mfu": mfu_figures(deployment, span),
        "rollouts": history, "active_rollout": active, "undo": undo_offer(deployment, active),
        "rollout_form": rollout_form or RolloutForm(deployment, prefix="rollout"),
        "panels": render_panels(request, deployment),
        "slo_scheduling": slo_scheduling_summary(deployment),
        "cold_starts": cold_start_rows(deployment),
    }, status=status)


def mfu_figures(deployment, span: str) -> dict:
    """mfu_summary over the last `span` (a RANGES key), with its figures as the page writes them."""
    seconds, words = RANGES[span]
    now = timezone.now()
    figures = mfu_summary(deployment, now - timedelta(seconds=seconds), now, now=now)
    figures["window"] = f"the last {words}"
    if "reason" in figures:
        return figures
    return {**figures, "text": {
        "mfu": f"{figures['mfu'] * 100:.2f} %", "tokens_per_s": f"{figures['tokens_per_s']:,.1f}",
        "flops_per_token": si(figures["flops_per_token"], "FLOPs"), "parameters": count_words(figures["parameters"]),
        "peak": f"{figures['peak_tflops']:g} TFLOP/s", "gpus": f"{figures['gpus']:.2f}",
    }}


def si(value: float, unit: str) -> str:
    """(1.606e10, "FLOPs") -> "16.06 GFLOPs"."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:g} {unit}"


def count_words(value: int) -> str:
    """8030261248 -> "8.03 billion"."""
    for factor, word in ((1e9, "billion"), (1e6, "million")):
        if value >= factor:
            return f"{value / factor:.2f} {word}"
    return f"{value:,}"


COLD_STARTS_SHOWN = 10


def cold_start_rows(deployment) -> dict:
    """The last starts with each phase's seconds, and each phase's median over them."""
    starts = list(deployment.replica_starts.select_related("version").order_by("-started_at", "-id")
                  [:COLD_STARTS_SHOWN])
    summary = cold_start.summary(starts)
    return {"rows": [{"start": start, "phases": list(cold_start.rounded(start).values())} for start in starts],
            "medians": [summary[phase]["median"] for phase in cold_start.PHASES]}
