"""The watch after a rollout succeeds: the platform rolls it back by itself when the new version burns
an SLO the previous version did not.

The deployment's reconcile pass (under its advisory lock) calls `watch()` every pass; it looks at
most every WATCH_EVERY_S through the SLO module's gate, stores each look as a RolloutMeasurement
(its step index is the number of steps: the watch comes after the last one), and on a failing
look starts the existing undo path (`rollouts.rollout_undo`, by the platform), marks the watched
rollout rolled_back with the reason, and raises a ticket alert that links it.

Like with like: while it is watched, the rollout keeps `holdback_percent` of the traffic on the previous
spec (a holdback track the reconcile pass plans, `holdback()`), and the gate compares the two at the same
time, so a change of load or of the machine is not blamed on the new version. Without a holdback the
gate compares with the previous version's past, at a comparable load only, and a failure must persist
for WATCH_PERSIST_S. Every look records both versions' load beside the verdict.

Only the rollout that brought the deployment to what it serves now (`rollouts.undo_target`) is
watched: a later rollout that succeeds, or a direct change of the deployment, ends its watch.
While another rollout runs the watch waits: that one is judged by its own analysis.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from datetime import datetime

from django.db import transaction

from deployments.choices import ACTIVE_ROLLOUT, RolloutStatus, Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts.gate import Measurement, gate
from deployments.rollouts.machine import MEASURE_EVERY_S, ROLLED_BACK_ALERT, add_timeline, raise_alert
from deployments.rollouts.services import rollout_undo, undo_target
from deployments.rollouts.spec import watch_limits
from inferops.audit import audit_record, snapshot

log = logging.getLogger(__name__)

WATCH_EVERY_S = MEASURE_EVERY_S
# Without a holdback to compare with at the same time, a failure must be seen this long.
WATCH_PERSIST_S = 30.0


def watch(deployment: Deployment, now: datetime) -> Rollout | None:
    """Look at the deployment's watched rollout if a look is due; returns the rollback it started, if any."""
    in_watch = list(deployment.rollouts.filter(status=RolloutStatus.SUCCEEDED, watch_until__gt=now))
    if not in_watch:
        return None
    target = undo_target(deployment)
    for rollout in in_watch:
        if target is None or rollout.pk != target.pk:
            _end_watch(rollout, now)
    watched = next((r for r in in_watch if target is not None and r.pk == target.pk and r.auto_rollback), None)
    if watched is None or _looked_recently(watched, now):
        return None
    with transaction.atomic():
        # The deployment's row first, as rollout_create takes it: no rollout starts during this look.
        Deployment.objects.select_for_update().get(pk=deployment.pk)
        rollout = (Rollout.objects.select_for_update().select_related("deployment", "stable_version",
                                                                      "candidate_version").get(pk=watched.pk))
        if not (rollout.auto_rollback and rollout.in_watch(now)) or \
                deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).exists():
            return None
        result = gate().watch(rollout, watch_limits(rollout.steps), now)
        same_time = any(c["ok"] is False and c.get("basis") == "same time" for c in result.checks)
        if result.verdict == Verdict.FAIL and not same_time:
            result = _persisting(rollout, result, now)
        RolloutMeasurement.objects.create(
            rollout=rollout, attempt=rollout.attempt, step_index=len(rollout.steps), taken_at=now,
            window_start=rollout.finished_at, window_end=now, verdict=result.verdict,
            candidate=result.candidate, stable=result.stable, checks=result.checks, reason=result.reason,
        )
        if result.verdict != Verdict.FAIL:
            return None
        return roll_back(rollout, deployment, now, result.reason)


def holdback(deployment: Deployment, now: datetime) -> Rollout | None:
    """The watched rollout that keeps part of the traffic on the previous spec now, if any."""
    candidates = deployment.rollouts.filter(status=RolloutStatus.SUCCEEDED, watch_until__gt=now, auto_rollback=True,
                                            rollback=False, holdback_percent__gt=0)
    if not candidates.exists():
        return None
    target = undo_target(deployment)
    return target if target is not None and target.holding_back(now) else None


def holdback_replicas(rollout: Rollout, replicas: int) -> int:
    """Replicas of the previous spec for the holdback: its share of the deployment's, at least one."""
    return max(1, math.ceil(replicas * rollout.holdback_percent / 100))


def roll_back(rollout: Rollout, deployment: Deployment, now: datetime, reason: str) -> Rollout:
    """Undo a watched rollout as the platform: the rollback rollout it starts, the reason recorded."""
    before = snapshot(rollout)
    rollback = rollout_undo(deployment=deployment, actor=None)
    rollout.status = RolloutStatus.ROLLED_BACK
    rollout.rolled_back_by = rollback
    rollout.watch_until = now
    rollout.message = f"Rolled back by the platform during its watch: {reason}"
    add_timeline(rollout, now, "rolled back",
                 f"{reason}; rollout {rollback.pk} puts v{rollout.stable_version.number} back")
    rollout.save()
    audit_record(actor=None, action="rollout.auto_rollback", obj=rollout, before=before, after=snapshot(rollout))
    raise_alert(rollout, now, ROLLED_BACK_ALERT,
                f"Rollout {rollout.pk} of {deployment.name} was rolled back by the platform", reason)
    log.warning("rollout %s rolled back during its watch: %s", rollout.pk, reason)
    return rollback


def _persisting(rollout: Rollout, result: Measurement, now: datetime) -> Measurement:
    """A failure judged against the previous version's past (not beside its holdback) stands only once every
    look has found it for WATCH_PERSIST_S: a short burst of slow requests or of load says little."""
    since = now
    for look in (RolloutMeasurement.objects.filter(rollout=rollout, step_index=len(rollout.steps))
                 .order_by("-taken_at").only("taken_at", "checks")):
        if not any(check.get("ok") is False for check in look.checks):
            break
        since = look.taken_at
    held = (now - since).total_seconds()
    if held >= WATCH_PERSIST_S:
        return replace(result, reason=f"{result.reason} Persisted for {held:.0f}s.")
    return replace(result, verdict=Verdict.RUNNING, reason=(
        f"{result.reason} Rolled back if it persists for {WATCH_PERSIST_S:.0f}s (seen for {held:.0f}s)."))


def _looked_recently(rollout: Rollout, now: datetime) -> bool:
    last = (RolloutMeasurement.objects.filter(rollout=rollout, step_index=len(rollout.steps))
            .order_by("-taken_at").values_list("taken_at", flat=True).first())
    return last is not None and (now - last).total_seconds() < WATCH_EVERY_S


def _end_watch(rollout: Rollout, now: datetime) -> None:
    """The deployment moved on (another rollout, or a direct change): nothing of this one to undo."""
    with transaction.atomic():
        locked = Rollout.objects.select_for_update().get(pk=rollout.pk)
        if not locked.in_watch(now):
            return
        locked.watch_until = now
        add_timeline(locked, now, "watch ended", "the deployment no longer serves what this rollout rolled out")
        locked.save(update_fields=["watch_until", "timeline", "updated_at"])
