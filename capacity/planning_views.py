"""The console's capacity-run button on the deployment page: the same checks and service as the API."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST
from rest_framework.exceptions import APIException

from capacity import runs
from capacity.planning_api import CapacityRunCreateSerializer
from deployments.models import Deployment
from inferops.forms import error_lines
from inferops.roles import require_operator


def run_body(post) -> tuple[dict, list[str]]:
    """The API body from the form (an empty box leaves the default), and what could not be read."""
    body, problems = {}, []
    if rates := post.get("rates", "").strip():
        try:
            body["rates"] = [float(item) for item in rates.replace(" ", ",").split(",") if item]
        except ValueError:
            problems.append(f"rates: {rates!r} is not numbers separated by commas (e.g. 1, 2, 4, 8).")
    if step_s := post.get("step_s", "").strip():
        body["step_s"] = step_s
    return body, problems


@login_required
@require_POST
def capacity_run_start(request, name: str):

    require_operator(request, "Starting a capacity run")
    deployment = get_object_or_404(Deployment.objects.select_related("model", "version"), name=name,
                                   deleted_at__isnull=True)
    back = reverse("deployments:detail", args=[name]) + "#capacity-plan"
    body, problems = run_body(request.POST)
    serializer = CapacityRunCreateSerializer(data=body, context={"deployment": deployment})
    if not problems and not serializer.is_valid():
        problems = [f"{path}: {message}" for field, value in serializer.errors.items()
                    for path, message in error_lines(value, field)]
    if problems:
        messages.error(request, "Capacity run not started: " + " ".join(problems))
        return redirect(back)
    try:
        run = runs.capacity_run_create(deployment=deployment, actor=request.user, **serializer.validated_data)
    except APIException as exc:  # another run is active, or no replica is ready
        messages.error(request, f"Capacity run not started: {exc.detail}")
        return redirect(back)
    rates = ", ".join(f"{rate:g}" for rate in run.rates)
    total_s = len(run.rates) * run.step_s
    takes = f"{total_s:.0f} s" if total_s < 120 else f"{total_s / 60:.0f} min"
    messages.success(request, f"Capacity run {run.pk} of {name} queued: {len(run.rates)} steps of {run.step_s:g} s "
                              f"at {rates} req/s against one replica, about {takes}. Its curve shows here when it "
                              "is done.")
    return redirect(back)
