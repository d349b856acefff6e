"""Window maths, error budgets, burn rates and the multiwindow burn-rate alert rules.

Pure functions over counts, no database: evaluation reads window sums from the running totals
and hands them here, so every number the API shows is computed in one place and tested by hand.

Time is in whole minutes (the SLI rows are per minute). A window of n minutes ending at minute
M holds the minutes (M - n, M]: the current, still filling minute included, so a fast burn shows
in the very cycle its minute starts.
"""

from __future__ import annotations

import math
import zoneinfo
from dataclasses import dataclass
from datetime import datetime, timedelta

from slo.choices import Budgeting, SloState, Window

MINUTE = timedelta(minutes=1)
# The burn-rate windows every status shows, in minutes (unscaled: they describe the recent past).
BURN_WINDOWS: dict[str, int] = {"5m": 5, "30m": 30, "1h": 60, "2h": 120, "6h": 360, "1d": 1440, "3d": 4320}
ROLLING_DAYS = {Window.DAY: 1, Window.WEEK: 7, Window.FOUR_WEEKS: 28, Window.MONTH: 30}
# The SRE workbook's table is written for a 30-day window; other windows scale it.
REFERENCE_PERIOD = timedelta(days=30)
WARNING_REMAINING = 0.25


# How far back a re-read of rows stamped in place goes (a scraped minute is updated while it
# lasts; a replica row's updated_at is its transaction's start, committed later).
OVERLAP = timedelta(minutes=2)


def floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


@dataclass(frozen=True)
class WindowSpan:
    """The budget window at one moment: its first minute, the current minute, its full length."""

    start: datetime
    current_minute: datetime
    period: timedelta

    @property
    def elapsed_minutes(self) -> int:
        return (self.current_minute - self.start) // MINUTE + 1

    @property
    def period_minutes(self) -> int:
        return self.period // MINUTE


def window_span(window: str, now: datetime, time_zone: str = "UTC") -> WindowSpan:
    """Rolling windows end at the current minute; calendar ones start at local midnight of the
    week's Monday or the month's first day (so a DST change makes that period 1 h shorter or longer)."""
    current = floor_minute(now)
    if window in ROLLING_DAYS:
        period = timedelta(days=ROLLING_DAYS[window])
        return WindowSpan(start=current - period + MINUTE, current_minute=current, period=period)
    zone = zoneinfo.ZoneInfo(time_zone)
    local = now.astimezone(zone)
    if window == Window.CALENDAR_WEEK:
        first_day = local.date() - timedelta(days=local.weekday())
        next_first_day = first_day + timedelta(days=7)
    elif window == Window.CALENDAR_MONTH:
        first_day = local.date().replace(day=1)
        next_first_day = (first_day + timedelta(days=32)).replace(day=1)
    else:
        raise ValueError(f"unknown window {window!r}")
    start = datetime.combine(first_day, datetime.min.time(), tzinfo=zone).astimezone(now.tzinfo)
    end = datetime.combine(next_first_day, datetime.min.time(), tzinfo=zone).astimezone(now.tzinfo)
    return WindowSpan(start=start, current_minute=current, period=end - start)


def nominal_period(window: str) -> timedelta:
    """The length alert windows scale by: calendar windows count as 7 and 30 days."""
    if window in ROLLING_DAYS:
        return timedelta(days=ROLLING_DAYS[window])
    return timedelta(days=7) if window == Window.CALENDAR_WEEK else REFERENCE_PERIOD


@dataclass(frozen=True)
class AlertRule:
    """Fire when the burn rate is at least `factor` over both the long and the short window."""

    severity: str
    factor: float
    long_minutes: int
    short_minutes: int

    @property
    def name(self) -> str:
        return f"{self.severity}-{self.factor:g}x-{self.long_minutes}m-{self.short_minutes}m"


REFERENCE_RULES = (
    AlertRule("page", 14.4, 60, 5),
    AlertRule("page", 6.0, 360, 30),
    AlertRule("ticket", 3.0, 1440, 120),
    AlertRule("ticket", 1.0, 4320, 360),
)


def alert_rules(window: str) -> tuple[AlertRule, ...]:
    """The reference table with its windows scaled by period / 30 days, rounded to whole minutes
    and clamped to at least one minute, since the SLI data are per minute (a 1d window pages on
    14.4x over 2 min and 1 min instead of 2 min and 10 s)."""
    scale = nominal_period(window) / REFERENCE_PERIOD
    return tuple(
        AlertRule(rule.severity, rule.factor, max(1, round(rule.long_minutes * scale)),
                  max(1, round(rule.short_minutes * scale)))
        for rule in REFERENCE_RULES
    )


@dataclass(frozen=True)
class Counts:
    """Sums over a window: events good and total, and minutes whose slice was bad."""

    good: int = 0
    total: int = 0
    bad_slices: int = 0

    @property
    def bad(self) -> int:
        return self.total - self.good

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.good - other.good, self.total - other.total, self.bad_slices - other.bad_slices)


@dataclass(frozen=True)
class Budget:
    sli: float | None
    budget_total: float
    budget_consumed: float
    budget_remaining: float  # fraction of budget_total left; negative when overspent


def occurrences_budget(counts: Counts, objective: float) -> Budget:
    """Budget = (1 - objective) x events in the window; each bad event consumes one."""
    allowed = (1 - objective) * counts.total
    sli = counts.good / counts.total if counts.total else None
    remaining = 1 - counts.bad / allowed if allowed > 0 else 1.0
    return Budget(sli=sli, budget_total=allowed, budget_consumed=counts.bad, budget_remaining=remaining)


def timeslices_budget(counts: Counts, objective: float, span: WindowSpan, observed_minutes: int) -> Budget:
    """Budget = (1 - objective) x minutes in the whole period; each bad minute consumes one.

    The SLI is the share of good minutes among those observed so far in the window (minutes
    before the SLO's data began are not observed, and do not flatter it)."""
    allowed = (1 - objective) * span.period_minutes
    sli = 1 - counts.bad_slices / observed_minutes if observed_minutes > 0 else None
    remaining = 1 - counts.bad_slices / allowed if allowed > 0 else 1.0
    return Budget(sli=sli, budget_total=allowed, budget_consumed=counts.bad_slices, budget_remaining=remaining)


def burn_rate(counts: Counts, objective: float, budgeting: str, minutes: int) -> float:
    """How fast the budget burns relative to using exactly all of it over the period: the bad
    share over the window divided by the allowed bad share (1 - objective)."""
    allowed_share = 1 - objective
    if budgeting == Budgeting.TIMESLICES:
        return (counts.bad_slices / minutes) / allowed_share if minutes > 0 else 0.0
    return (counts.bad / counts.total) / allowed_share if counts.total > 0 else 0.0


def time_to_exhaustion_s(budget_remaining: float, burn_1h: float, period: timedelta) -> float | None:
    """Seconds until the budget is gone if the 1h burn rate holds: at rate b, b periods' worth of
    budget burn per period. None when nothing burns; 0 when already spent."""
    if budget_remaining <= 0:
        return 0.0
    if burn_1h <= 0 or not math.isfinite(burn_1h):
        return None
    return budget_remaining * period.total_seconds() / burn_1h


def enough_events(events: int, min_events: int) -> bool:
    """The low-traffic guard: with fewer events one slow request reads as a spent budget (1 bad
    of 2 at 0.99 is a 50x burn), so nothing is judged below the SLO's minimum."""
    return events >= min_events


def slo_state(budget_remaining: float, alert_firing: bool, *, events: int | None = None, min_events: int = 0) -> str:
    if events is not None and not enough_events(events, min_events):
        return SloState.INSUFFICIENT
    if budget_remaining <= 0:
        return SloState.EXHAUSTED
    if budget_remaining < WARNING_REMAINING or alert_firing:
        return SloState.WARNING
    return SloState.OK


@dataclass(frozen=True)
class RuleVerdict:
    rule: AlertRule
    long_burn: float
    short_burn: float
    long_events: int
    min_requests: int

    @property
    def enough_traffic(self) -> bool:
        return enough_events(self.long_events, self.min_requests)

    @property
    def firing(self) -> bool:
        return self.enough_traffic and self.long_burn >= self.rule.factor and self.short_burn >= self.rule.factor
