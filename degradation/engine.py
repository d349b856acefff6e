"""The policy engine: after each SLO evaluation cycle, move every deployment's degradation level.

Per deployment with a policy: the burn rate of each watched SLO over the policy's window, as the
evaluation cycle just computed it (the same exact per-request SLIs as the SLO's own burn rates)
and handed over by slo.signals; for a TTFT SLO the worse of that and the early burn, from the
gateways' verdicts at each request's first token or TTFT deadline over the last twelfth of the
window (at least EARLY_WINDOW_MIN_S), which sees an overload while its requests are still in
flight. The worst of them goes against the levels' thresholds, with at most one level's move per
cycle:
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
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from redis.exceptions import RedisError

from degradation import gateway
from degradation.models import DegradationPolicy, DegradationState, LevelChange
from degradation.services import (
    covering_slos,  # noqa: F401 - the console and the API import it from here
    gateway_document,
    level_move,
    locked_state,
    override_active,
    override_reset,
    watched_slos,
)
from deployments.models import Deployment
from slo.budget import MINUTE, Counts, burn_rate, floor_minute
from slo.choices import Budgeting
from slo.evaluation import Evaluation, running_totals_at
from slo.models import Slo

log = logging.getLogger(__name__)

MAX_HOLD_S = 3600
EARLY_WINDOW_MIN_S = 10.0


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


def early_window_s(policy: DegradationPolicy) -> float:
    # As a multiwindow burn-rate alert pairs its window with one a twelfth as long (1h with 5m).
    return max(EARLY_WINDOW_MIN_S, policy.window_minutes * 60 / 12)


def _policies() -> list[DegradationPolicy]:
    return list(DegradationPolicy.objects.select_related("deployment", "deployment__model").prefetch_related("slos"))


def policy_windows(slos: list[Slo]) -> dict[int, set[int]]:
    """slo.signals.burn_windows: each watched SLO's policy windows, for the cycle to compute."""
    ids = {slo.pk for slo in slos}
    wanted: dict[int, set[int]] = defaultdict(set)
    for policy in _policies():
        for slo in watched_slos(policy):
            if slo.pk in ids:
                wanted[slo.pk].add(policy.window_minutes)
    return wanted


def measured_burns(policy: DegradationPolicy, slos: list[Slo], evaluations: dict[int, Evaluation],
                   now: datetime) -> dict[str, float]:
    """SLO name -> burn, for the watched SLOs with at least min_requests behind the burn: over the
    window from the cycle's evaluation, and for a TTFT SLO also early, from the gateways."""
    burns: dict[str, float] = {}
    for slo in slos:
        evaluation = evaluations.get(slo.pk)
        burn, requests = evaluation.window_burns.get(policy.window_minutes, (0.0, 0)) if evaluation else (0.0, 0)
        if requests >= slo.min_requests:
            burns[slo.name] = burn
    deadlines = gateway.ttft_deadlines(slos)
    if not deadlines:
        return burns
    try:
        early = gateway.early_counts(policy.deployment.name, deadlines,
                                     gateway.EarlyWindow(now.timestamp(), early_window_s(policy)))
    except RedisError as exc:
        log.warning("degradation: no early TTFT verdicts for %s: %s", policy.deployment.name, exc)
        return burns
    for slo in slos:
        counts = early.get(slo.ttft_ms) if gateway.early_judged(slo) else None
        if counts is not None and counts.total >= slo.min_requests:
            early_burn = burn_rate(counts, slo.objective, Budgeting.OCCURRENCES, 0)
            burns[slo.name] = max(burns.get(slo.name, 0.0), early_burn)
    return burns


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


def run_cycle(now: datetime, evaluations: dict[int, Evaluation]) -> list[tuple[str, int, int]]:
    """One engine pass over every policy, on the cycle's evaluations; returns the (deployment, from,
    to) moves made."""
    policies = _policies()
    watched = {policy.pk: watched_slos(policy) for policy in policies}
    published = _published()
    moves = []
    for policy in policies:
        slos = watched[policy.pk]
        counted = {name: round(burn, 4) for name, burn in measured_burns(policy, slos, evaluations, now).items()}
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
                _heal(policy, published)
    return moves


def _published() -> dict[str, dict] | None:
    try:
        return gateway.published()
    except RedisError as exc:
        log.warning("degradation: published entries unreadable: %s", exc)
        return None


def _heal(policy: DegradationPolicy, published: dict[str, dict] | None) -> None:
    """Publish the entry again where the gateways' copy differs from the database's (a publish lost
    while Redis was down, a watched SLO's new threshold). Under the state row's lock, so no level
    move commits in between."""
    if published is None:
        return
    actions = Deployment.objects.filter(pk=policy.deployment_id).values_list("degradation", flat=True).first()
    document = gateway_document(policy, actions)
    if published.get(policy.deployment.name) != document:
        gateway.publish_on_commit(policy.deployment.name, document)


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


def on_cycle_evaluated(sender, now: datetime, evaluations: dict[int, Evaluation], **kwargs) -> None:
    moves = run_cycle(now, evaluations)
    if moves:
        log.info("degradation: %s", ", ".join(f"{name} {a}->{b}" for name, a, b in moves))
