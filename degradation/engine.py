"""The policy engine: after each SLO evaluation cycle, move every deployment's degradation level.

Per deployment with a policy: the burn rate of each watched SLO over the policy's window (the
same exact per-request SLIs as the SLO's own burn rates: a difference of two running totals),
the worst of them against the levels' thresholds, and at most one level's move per cycle:
- up one level when the worst burn reaches the next level's entry rate;
- down one level when it falls below the current level's exit rate (exit <= entry: hysteresis);
- never before the current level's hold time has passed, either way; a level re-entered soon
  after leaving it (its shedding had hidden an overload that was still there) doubles the hold,
  up to an hour, so the level stops flapping; a calm re-entry resets it;
- an SLO with fewer requests in the window than its min_requests does not count; with no SLO
  counting the level never goes up, and goes down only once a whole window passed so (a window
  that just rolled over, or traffic the level sheds, is no evidence that the burn stopped).
An operator's override holds a level (0: off) until it expires; then the policy takes over again
from where the level is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q

from degradation.models import DegradationPolicy, DegradationState, LevelChange
from degradation.services import level_move, locked_state, override_active, override_reset
from slo.budget import MINUTE, Counts, burn_rate, floor_minute
from slo.choices import Scope
from slo.evaluation import running_totals_at
from slo.models import Slo

log = logging.getLogger(__name__)

MAX_HOLD_S = 3600


@dataclass(frozen=True)
class Level:
    name: str
    enter_burn_rate: float
    exit_burn_rate: float


def decide(*, level: int, since: datetime | None, worst_burn: float | None, levels: list[Level],
           hold: timedelta, now: datetime, measured_at: datetime | None = None,
           window: timedelta = timedelta(minutes=5)) -> tuple[int, str]:
    """The level to be at after this cycle, and why (empty reason: stay). `measured_at`: the last
    cycle that had a burn to judge; without one for a whole `window` the level steps down."""
    if level > len(levels):
        return len(levels), "the policy has fewer levels now"
    if since is not None and now - since < hold:
        return level, ""
    if worst_burn is not None and level < len(levels) and worst_burn >= levels[level].enter_burn_rate:
        entered = levels[level]
        return level + 1, f"burn rate {worst_burn:.2f} reached {entered.name}'s entry rate {entered.enter_burn_rate:g}"
    if level > 0:
        current = levels[level - 1]
        if worst_burn is None:
            # A window that just rolled over, or traffic the level sheds, shows nothing for a
            # while: that is no evidence the burn stopped. Only a whole silent window is.
            if measured_at is not None and now - measured_at < window:
                return level, ""
            return level - 1, (f"no watched SLO has had enough requests to show a burn for "
                               f"{window.total_seconds() / 60:g} min")
        if worst_burn < current.exit_burn_rate:
            return level - 1, (f"burn rate {worst_burn:.2f} fell below {current.name}'s exit rate "
                               f"{current.exit_burn_rate:g}")
    return level, ""


def levels_of(policy: DegradationPolicy) -> list[Level]:
    return [Level(spec["name"], float(spec["enter_burn_rate"]), float(spec["exit_burn_rate"]))
            for spec in policy.levels]


def watched_slos(policy: DegradationPolicy) -> list[Slo]:
    chosen = list(policy.slos.all())
    if chosen:
        return chosen
    return list(covering_slos(policy.deployment))


def covering_slos(deployment):
    """The SLOs a policy may watch: the deployment's own and its model's."""
    return Slo.objects.filter(Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id))


def window_burn_rates(slos: list[Slo], minutes: int, now: datetime) -> dict[int, tuple[float, int]]:
    """SLO id -> (burn rate, requests) over the `minutes` ending with the current one."""
    return burn_rate_series(slos, minutes, [now])[0]


def burn_rate_series(slos: list[Slo], minutes: int, moments: list[datetime]) -> list[dict[int, tuple[float, int]]]:
    """window_burn_rates at each of `moments`, from one query (the console charts what the engine saw)."""
    ends = [floor_minute(moment) for moment in moments]
    probes = {(slo.pk, minute) for slo in slos for end in ends for minute in (end, end - minutes * MINUTE)}
    totals = running_totals_at(list(probes))
    series = []
    for end in ends:
        rates = {}
        for slo in slos:
            counts: Counts = totals[(slo.pk, end)] - totals[(slo.pk, end - minutes * MINUTE)]
            rates[slo.pk] = (burn_rate(counts, slo.objective, slo.budgeting, minutes), counts.total)
        series.append(rates)
    return series


def run_cycle(now: datetime) -> list[tuple[str, int, int]]:
    """One engine pass over every policy; returns the (deployment, from, to) moves made."""
    policies = list(DegradationPolicy.objects.select_related("deployment", "deployment__model")
                    .prefetch_related("slos"))
    watched = {policy.pk: watched_slos(policy) for policy in policies}
    moves = []
    for policy in policies:
        slos = watched[policy.pk]
        rates = window_burn_rates(slos, policy.window_minutes, now) if slos else {}
        counted = {slo.name: round(rates[slo.pk][0], 4) for slo in slos if rates[slo.pk][1] >= slo.min_requests}
        with transaction.atomic():
            state = locked_state(policy.deployment)
            state.burn_rates, state.evaluated_at = counted, now
            if counted:
                state.measured_at = now
            target, reason = _target(policy, state, counted, now)
            if target > state.level:
                reason += _count_relapse(policy, state, target, now)
            if target != state.level:
                moves.append((policy.deployment.name, state.level, target))
                level_move(state=state, policy=policy, to_level=target, reason=reason, now=now)
            else:
                state.save(update_fields=["burn_rates", "evaluated_at", "measured_at"])
    return moves


def _target(policy: DegradationPolicy, state: DegradationState, counted: dict[str, float],
            now: datetime) -> tuple[int, str]:
    if policy.deployment.deleted_at is not None:
        return 0, "deployment deleted"  # resolves its alert before the rows go
    if state.override_until is not None:
        if override_active(state, now):
            return state.override_level, "held by an operator's override"
        override_reset(state)  # expired: the policy decides again, from the level the override left
    if not policy.enabled:
        return 0, "policy disabled"
    worst = max(counted.values()) if counted else None
    return decide(level=state.level, since=state.since, worst_burn=worst, levels=levels_of(policy),
                  hold=effective_hold(policy, state), now=now, measured_at=state.measured_at,
                  window=timedelta(minutes=policy.window_minutes))


def effective_hold(policy: DegradationPolicy, state: DegradationState) -> timedelta:
    return timedelta(seconds=min(MAX_HOLD_S, policy.hold_s * 2 ** state.relapses))


def _count_relapse(policy: DegradationPolicy, state: DegradationState, target: int, now: datetime) -> str:
    """Going up to the level just left, within its hold and a window of leaving it, is a relapse."""
    last = LevelChange.objects.filter(deployment=policy.deployment).first()
    soon = effective_hold(policy, state) + timedelta(minutes=policy.window_minutes)
    if last is not None and last.from_level == target > last.to_level and now - last.at < soon:
        state.relapses += 1
        return (f"; re-entered {(now - last.at).total_seconds():.0f} s after leaving it, so it is held "
                f"{effective_hold(policy, state).total_seconds():.0f} s now")
    state.relapses = 0
    return ""


def on_cycle_evaluated(sender, now: datetime, **kwargs) -> None:
    moves = run_cycle(now)
    if moves:
        log.info("degradation: %s", ", ".join(f"{name} {a}->{b}" for name, a, b in moves))
