"""Window maths, budgets and burn rates against hand-worked cases (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from slo.budget import (
    Counts,
    RuleVerdict,
    alert_rules,
    burn_rate,
    occurrences_budget,
    slo_state,
    time_to_exhaustion_s,
    timeslices_budget,
    window_span,
)

NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC)  # Tuesday


def test_rolling_window_ends_at_the_current_minute():
    span = window_span("7d", NOW)
    assert span.current_minute == datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
    assert span.start == datetime(2026, 3, 3, 12, 1, tzinfo=UTC)
    assert span.elapsed_minutes == span.period_minutes == 7 * 1440


def test_calendar_week_starts_monday_midnight_in_the_slo_time_zone():
    span = window_span("calendar-week", NOW, "America/New_York")
    # Monday 9 March 00:00 in New York (EDT since 8 March) is 04:00 UTC.
    assert span.start == datetime(2026, 3, 9, 4, 0, tzinfo=UTC)
    assert span.period == timedelta(days=7)
    assert span.elapsed_minutes == 32 * 60 + 1  # 04:00 Monday .. 12:00 Tuesday, both minutes included


def test_calendar_month_across_a_dst_change_is_one_hour_short():
    span = window_span("calendar-month", NOW, "Europe/Berlin")
    assert span.start == datetime(2026, 2, 28, 23, 0, tzinfo=UTC)  # 1 March 00:00 CET
    assert span.period == timedelta(days=31) - timedelta(hours=1)  # CEST begins 29 March
    assert window_span("calendar-month", NOW).period == timedelta(days=31)


def test_occurrences_budget_hand_worked():
    # 99.5% over 10,000 requests allows 50 bad; 20 bad used 40% of it.
    budget = occurrences_budget(Counts(good=9980, total=10000), 0.995)
    assert budget.sli == pytest.approx(0.998)
    assert budget.budget_total == pytest.approx(50)
    assert budget.budget_consumed == 20
    assert budget.budget_remaining == pytest.approx(0.6)
    overspent = occurrences_budget(Counts(good=9900, total=10000), 0.995)
    assert overspent.budget_remaining == pytest.approx(-1.0)
    empty = occurrences_budget(Counts(), 0.995)
    assert empty.sli is None and empty.budget_remaining == 1.0


def test_timeslices_budget_hand_worked():
    # 99% of the 1440 minutes of a day may be bad 14.4 minutes; 6 bad minutes out of 600 observed.
    span = window_span("1d", NOW)
    budget = timeslices_budget(Counts(bad_slices=6), 0.99, span, observed_minutes=600)
    assert budget.budget_total == pytest.approx(14.4)
    assert budget.budget_remaining == pytest.approx(1 - 6 / 14.4)
    assert budget.sli == pytest.approx(1 - 6 / 600)


def test_burn_rates():
    # 1% errors against a 99.9% objective burns 10x; timeslices: 3 bad of 60 minutes at 95% = 1x.
    assert burn_rate(Counts(good=990, total=1000), 0.999, "occurrences", 60) == pytest.approx(10)
    assert burn_rate(Counts(bad_slices=3), 0.95, "timeslices", 60) == pytest.approx(1)
    assert burn_rate(Counts(), 0.999, "occurrences", 60) == 0


def test_time_to_exhaustion():
    # Half the 30-day budget left at 2x burns out in 7.5 days.
    assert time_to_exhaustion_s(0.5, 2.0, timedelta(days=30)) == pytest.approx(7.5 * 86400)
    assert time_to_exhaustion_s(0.5, 0.0, timedelta(days=30)) is None
    assert time_to_exhaustion_s(-0.1, 3.0, timedelta(days=30)) == 0


def test_state():
    assert slo_state(0.5, alert_firing=False) == "ok"
    assert slo_state(0.2, alert_firing=False) == "warning"
    assert slo_state(0.9, alert_firing=True) == "warning"
    assert slo_state(0.0, alert_firing=False) == "exhausted"


def test_alert_windows_scale_with_the_slo_window():
    reference = [(r.severity, r.factor, r.long_minutes, r.short_minutes) for r in alert_rules("30d")]
    assert reference == [("page", 14.4, 60, 5), ("page", 6.0, 360, 30), ("ticket", 3.0, 1440, 120),
                         ("ticket", 1.0, 4320, 360)]
    # 1d: 1h -> 2 min, 5 min -> 10 s clamped to the 1-minute resolution.
    day = [(r.long_minutes, r.short_minutes) for r in alert_rules("1d")]
    assert day == [(2, 1), (12, 1), (48, 4), (144, 12)]
    assert [(r.long_minutes, r.short_minutes) for r in alert_rules("7d")] == [(14, 1), (84, 7), (336, 28),
                                                                              (1008, 84)]
    assert alert_rules("calendar-month") == alert_rules("30d")


def test_rule_needs_both_windows_and_enough_traffic():
    rule = alert_rules("30d")[0]
    assert RuleVerdict(rule, long_burn=15, short_burn=20, long_events=100, min_requests=20).firing
    assert not RuleVerdict(rule, long_burn=15, short_burn=2, long_events=100, min_requests=20).firing
    assert not RuleVerdict(rule, long_burn=2, short_burn=20, long_events=100, min_requests=20).firing
    assert not RuleVerdict(rule, long_burn=15, short_burn=20, long_events=19, min_requests=20).firing
