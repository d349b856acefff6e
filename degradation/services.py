"""Writes of the degradation app: the policy, level moves (by the engine or an operator), overrides.

Every level move is one transaction on the locked state row: a LevelChange row, the actions of
the new level put in force on the deployment (published to the gateways as the transaction
commits, and in the routing table by the next reconcile pass), an audit event, and the ticket
alert opened, updated or resolved.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from alerts.choices import Severity
from alerts.services import alert_raise, alerts_resolve_open
from degradation import gateway
from degradation.models import DegradationPolicy, DegradationState, LevelChange
from deployments.models import Deployment
from deployments.services import deployment_set_degradation
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record
from slo.choices import Scope
from slo.models import Slo

log = logging.getLogger(__name__)

ALERT_NAME = "DeploymentDegraded"
ACTION_NAMES = ("shed_below_priority", "max_tokens_cap", "fallback", "scale_up", "freeze_rollouts")
HISTORY_LIMIT = 50


def retry_after_s(policy: DegradationPolicy) -> int:
    """What shed clients are told: the hold time, the soonest a level can end, within 5 s to 5 min."""
    return max(5, min(300, policy.hold_s))


def level_actions(policy: DegradationPolicy, level: int) -> dict | None:
    """The actions document of a level as Deployment.degradation holds it; None at level 0."""
    if level == 0:
        return None
    spec = policy.levels[level - 1]
    actions = spec.get("actions") or {}
    return {"level": level, "name": spec["name"], **{name: actions.get(name) for name in ACTION_NAMES},
            "retry_after_s": retry_after_s(policy)}


def watched_slos(policy: DegradationPolicy) -> list[Slo]:
    chosen = list(policy.slos.all())
    if chosen:
        return chosen
    return list(covering_slos(policy.deployment))


def covering_slos(deployment):
    """The SLOs a policy may watch: the deployment's own and its model's."""
    return Slo.objects.filter(Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id))


def gateway_document(policy: DegradationPolicy | None, actions: dict | None) -> dict:
    """What the gateways get: the actions in force and, while the policy is on, the TTFT deadlines
    of the SLOs it watches (they count early verdicts against them)."""
    deadlines = gateway.ttft_deadlines(watched_slos(policy)) if policy is not None and policy.enabled else []
    return gateway.entry(actions, deadlines)


def locked_state(deployment: Deployment) -> DegradationState:
    DegradationState.objects.get_or_create(deployment=deployment)
    return DegradationState.objects.select_for_update().get(deployment=deployment)


def level_name(policy: DegradationPolicy | None, level: int) -> str:
    if level == 0:
        return "normal"
    if policy is None or level > len(policy.levels):
        return f"level {level}"
    return policy.levels[level - 1]["name"]


def level_move(*, state: DegradationState, policy: DegradationPolicy | None, to_level: int, reason: str,
               now: datetime, actor=None) -> LevelChange:
    """Move a locked state row to `to_level`; the caller holds the transaction."""
    deployment = state.deployment
    from_level = state.level
    change = LevelChange.objects.create(deployment=deployment, at=now, from_level=from_level, to_level=to_level,
                                        reason=reason, burn_rates=state.burn_rates, actor=actor)
    state.level, state.since = to_level, now
    state.save(update_fields=["level", "since", "burn_rates", "evaluated_at", "measured_at", "relapses"])
    actions = level_actions(policy, to_level) if policy is not None else None
    deployment_set_degradation(deployment=deployment, actions=actions)
    gateway.publish_on_commit(deployment.name, gateway_document(policy, actions))
    audit_record(actor=actor, action="degradation.level", obj=deployment,
                 before={"level": from_level, "name": level_name(policy, from_level)},
                 after={"level": to_level, "name": level_name(policy, to_level), "reason": reason,
                        "burn_rates": state.burn_rates, "actions": actions})
    _sync_alert(deployment, policy, to_level, reason, now)
    log.warning("deployment %s degradation %d -> %d: %s", deployment.name, from_level, to_level, reason)
    return change


def _sync_alert(deployment: Deployment, policy: DegradationPolicy | None, level: int, reason: str,
                now: datetime) -> None:
    if level == 0:
        alerts_resolve_open(now=now, alertnames=(ALERT_NAME,), deployment=deployment.name)
        return
    alert_raise(
        labels={"alertname": ALERT_NAME, "deployment": deployment.name, "severity": Severity.TICKET},
        annotations={"summary": f"{deployment.name} is degraded: level {level} ({level_name(policy, level)})",
                     "description": reason,
                     "deployment_url": f"{settings.INFEROPS_EXTERNAL_URL}/deployments/{deployment.name}/"},
        severity=Severity.TICKET, now=now,
    )


# ---------------------------------------------------------------------------- policy


def policy_save(*, deployment: Deployment, actor, enabled: bool, window_minutes: int, hold_s: int, slos: list,
                levels: list[dict]) -> DegradationPolicy:
    """Create or replace the deployment's policy (validated by the API's serializer). A level the
    new policy no longer has, or a disabled policy, takes the deployment down at once."""
    now = timezone.now()
    with transaction.atomic():
        state = locked_state(deployment)
        policy = DegradationPolicy.objects.filter(deployment=deployment).first()
        before = policy_document(policy) if policy else None
        if policy is None:
            policy = DegradationPolicy(deployment=deployment, created_by=actor_or_none(actor))
        policy.enabled, policy.window_minutes, policy.hold_s, policy.levels = enabled, window_minutes, hold_s, levels
        policy.save()
        policy.slos.set(slos)
        audit_record(actor=actor, action="degradation.policy", obj=deployment, before=before,
                     after=policy_document(policy))
        if state.level > len(levels) or (state.level and not enabled and not override_active(state, now)):
            to_level = 0 if not enabled else len(levels)
            level_move(state=state, policy=policy, to_level=to_level, now=now, actor=actor,
                       reason="policy disabled" if not enabled else "the new policy has fewer levels")
        elif state.level:
            # Same level, maybe new actions: put them in force now.
            deployment_set_degradation(deployment=deployment, actions=level_actions(policy, state.level))
        # New deadlines (the watched SLOs), maybe new actions: to the gateways now.
        gateway.publish_on_commit(deployment.name, gateway_document(policy, level_actions(policy, state.level)))
    return policy


def policy_document(policy: DegradationPolicy) -> dict:
    return {"enabled": policy.enabled, "window": f"{policy.window_minutes}m", "hold_s": policy.hold_s,
            "slos": sorted(slo.name for slo in policy.slos.all()), "levels": policy.levels}


# ---------------------------------------------------------------------------- overrides


def override_active(state: DegradationState, now: datetime) -> bool:
    return state.override_until is not None and state.override_until > now


def override_set(*, deployment: Deployment, actor, level: int, until: datetime, reason: str) -> DegradationState:
    """Hold the deployment at `level` (0: degradation off) until `until`, whatever the burn."""
    now = timezone.now()
    with transaction.atomic():
        policy = DegradationPolicy.objects.filter(deployment=deployment).first()
        if policy is None:
            raise Conflict(f"{deployment.name!r} has no degradation policy: PUT one to "
                           f"/api/v1/deployments/{deployment.name}/degradation/ first.")
        state = locked_state(deployment)
        state.override_level, state.override_until, state.override_reason = level, until, reason
        state.override_by = actor_or_none(actor)
        state.save(update_fields=["override_level", "override_until", "override_reason", "override_by"])
        audit_record(actor=actor, action="degradation.override", obj=deployment,
                     after={"level": level, "until": until.isoformat(), "reason": reason})
        if state.level != level:
            who = getattr(actor, "username", None) or "an operator"
            level_move(state=state, policy=policy, to_level=level, now=now, actor=actor,
                       reason=f"forced by {who} until {until:%Y-%m-%d %H:%M} UTC: {reason}")
    return state


def override_clear(*, deployment: Deployment, actor, reason: str = "") -> DegradationState:
    """End an override now; the policy takes over again at the next evaluation cycle."""
    with transaction.atomic():
        state = locked_state(deployment)
        if state.override_until is None:
            raise Conflict(f"{deployment.name!r} has no degradation override to clear.")
        before = {"level": state.override_level, "until": state.override_until.isoformat(),
                  "reason": state.override_reason}
        override_reset(state)
        audit_record(actor=actor, action="degradation.override_clear", obj=deployment, before=before,
                     after={"reason": reason})
    return state


def override_reset(state: DegradationState) -> None:
    state.override_level = state.override_until = state.override_by = None
    state.override_reason = ""
    state.save(update_fields=["override_level", "override_until", "override_reason", "override_by"])


def history(deployment: Deployment, limit: int = HISTORY_LIMIT) -> list[LevelChange]:
    return list(LevelChange.objects.filter(deployment=deployment).select_related("actor")[:limit])
