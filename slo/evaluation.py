"""`evaluate-slos`: derive what the usage pipeline added into the per-minute SLI rows, then compute
budgets, burn rates and alerts for every SLO, at a cost that does not grow with stored history.

The scheme, and why it is exact and idempotent:
1. The usage pipeline (slo/usage.py, in each ingest transaction) judges every new event once and
   adds it into its SLO's minute by event time, marking the row stale: a late event is counted
   in its own minute however late, and a redelivered one is never counted twice (ingest stores
   an event once, and only newly stored events reach the pipeline).
2. A cycle derives the stale rows' timeslice verdicts and the running totals (`cum_*`) from each
   SLO's earliest stale minute on, starting from the row before it: a late event costs as many
   rows as it is late, not the whole history.
3. A window's sums are the difference of two running totals, found by index probes ("the last
   row at or before t") for all SLOs and all windows in one query.
An SLO evaluated for the first time (or redefined) is back-filled from the stored events of the
last BACKFILL_LIMIT (the usage-event retention) through the SLI SQL; `backfilled_from` says where
its data begin. Ratio SLIs re-read their scraped minutes from the watermark minus OVERLAP (the
scraper updates the current minute's row in place), recompute and upsert. Quality SLIs read no usage
events: their eval runs add into their minutes like the pipeline does (slo/quality.py), and their
back-fill counts the stored runs; the cycle then judges their latest run against the floor.
"""

from __future__ import annotations

import logging
import time as clock
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from alerts.choices import Severity
from inferops.locks import LockId, try_advisory_lock
from slo import signals
from slo.budget import (
    BURN_WINDOWS,
    MINUTE,
    OVERLAP,
    Budget,
    Counts,
    RuleVerdict,
    alert_rules,
    burn_rate,
    enough_events,
    floor_minute,
    occurrences_budget,
    slo_state,
    time_to_exhaustion_s,
    timeslices_budget,
    window_span,
)
from slo.choices import Budgeting, SliKind
from slo.models import Slo, SloStatus
from slo.quality import QualityVerdict, backfill_runs, with_verdicts
from slo.sli import REQUEST_BACKFILL_SQL, SliQuery, ratio_query
from slo.usage import FOLD_LOCK

log = logging.getLogger(__name__)

BACKFILL_LIMIT = timedelta(days=35)


@dataclass
class CycleReport:
    slos: int = 0
    slos_with_new_data: int = 0
    minutes_upserted: int = 0
    touched_keys: int = 0
    alerts_opened: int = 0
    alerts_updated: int = 0
    alerts_resolved: int = 0
    skipped: bool = False
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    # slo id -> what the cycle found; for the apps told of the cycle (slo.signals), not the report
    evaluations: dict[int, Evaluation] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "evaluations"}


# ---------------------------------------------------------------------------- minute rows

_UPSERT = """
    INSERT INTO slo_slominute (slo_id, minute, good, total, bad_slice, cum_good, cum_total, cum_bad_slices)
    SELECT c.slo_id, c.minute, least(c.good, c.total), c.total,
           coalesce(s.budgeting = 'timeslices' AND c.total > 0
                    AND least(c.good, c.total)::float8 / c.total < s.timeslice_target, false), 0, 0, 0
    FROM ({counted}) c JOIN slo_slo s ON s.id = c.slo_id
    ON CONFLICT (slo_id, minute) DO UPDATE
    SET good = EXCLUDED.good, total = EXCLUDED.total, bad_slice = EXCLUDED.bad_slice
"""
def _ratio_range(query: SliQuery) -> str:
    return f"""
        SELECT %(slo_id)s::bigint AS slo_id, date_trunc('minute', e.{query.time_column}) AS minute,
               {query.good_sql} AS good, {query.total_sql} AS total
        FROM {query.table} e
        WHERE {query.scope_sql} AND e.{query.time_column} >= %(start)s AND e.{query.time_column} < %(end)s
        GROUP BY 1, 2
    """


def _refresh_running_totals(starts: dict[int, datetime]) -> None:
    """Running totals of each SLO's rows from its start minute on, continuing the row before.

    Two statements, each an index walk over only the rows from `start` on: a SELECT of the rows
    whose totals change (OFFSET 0 keeps the planner from flattening the per-SLO range scan into
    a scan of the whole table) and an UPDATE of those by primary key."""
    if not starts:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT r.id, r.good, r.total, r.bad_slices
            FROM unnest(%s::bigint[], %s::timestamptz[]) AS st(slo_id, start)
            LEFT JOIN LATERAL (
                SELECT cum_good, cum_total, cum_bad_slices FROM slo_slominute
                WHERE slo_id = st.slo_id AND minute < st.start ORDER BY minute DESC LIMIT 1
            ) p ON true
            CROSS JOIN LATERAL (
                SELECT id, cum_good, cum_total, cum_bad_slices,
                       coalesce(p.cum_good, 0) + sum(good) OVER w AS good,
                       coalesce(p.cum_total, 0) + sum(total) OVER w AS total,
                       coalesce(p.cum_bad_slices, 0) + sum(bad_slice::int) OVER w AS bad_slices
                FROM slo_slominute
                WHERE slo_id = st.slo_id AND minute >= st.start
                WINDOW w AS (ORDER BY minute)
                ORDER BY minute
                OFFSET 0
            ) r
            WHERE (r.cum_good, r.cum_total, r.cum_bad_slices) IS DISTINCT FROM (r.good, r.total, r.bad_slices)
            """,
            [list(starts), list(starts.values())],
        )
        changed = cursor.fetchall()
        if changed:
            cursor.execute(
                "UPDATE slo_slominute m SET cum_good = u.good, cum_total = u.total, cum_bad_slices = u.bad_slices "
                "FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[]) AS u(id, good, total, bad_slices) "
                "WHERE m.id = u.id",
                [list(column) for column in zip(*changed, strict=True)],
            )


def _execute(sql: str, params: dict) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def _database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def backfill(slo: Slo, now: datetime) -> int:
    """First evaluation: every stored source row of the last BACKFILL_LIMIT becomes minute rows."""
    params = {"slo_id": slo.pk, "start": floor_minute(now - BACKFILL_LIMIT), "end": floor_minute(now) + MINUTE}
    with transaction.atomic():
        if slo.sli_kind == SliKind.RATIO:
            read_at = None
            query = ratio_query(slo)
            written = _execute(_UPSERT.format(counted=_ratio_range(query)), {**query.params, **params})
        else:
            # Exclusive: waits for the batches in flight, whose events it then reads; the batches
            # after it see the watermark set and add their events themselves.
            _execute("SELECT pg_advisory_xact_lock(%s, %s)", FOLD_LOCK)
            read_at = _database_now()
            if slo.sli_kind == SliKind.QUALITY:
                with connection.cursor() as cursor:
                    written = backfill_runs(cursor, slo, params["start"])
            else:
                written = _execute(_UPSERT.format(counted=REQUEST_BACKFILL_SQL), params)
        _refresh_running_totals({slo.pk: params["start"]})
        first = slo.minutes.order_by("minute").values_list("minute", flat=True).first()
        created = floor_minute(slo.created_at or now)
        slo.backfilled_from = min(first, created) if first else created
        slo.watermark = floor_minute(now) if slo.sli_kind == SliKind.RATIO else read_at
        Slo.objects.filter(pk=slo.pk).update(backfilled_from=slo.backfilled_from, watermark=slo.watermark)
    return written


# Stale rows: what the usage pipeline added since the last cycle (slo/usage.py).
_STALE_STARTS = """
    SELECT slo_id, min(minute), count(*) FROM slo_slominute WHERE stale AND slo_id = ANY(%s) GROUP BY slo_id
"""
_DERIVE_SLICES = """
    UPDATE slo_slominute m
    SET stale = false, bad_slice = coalesce(s.budgeting = 'timeslices' AND m.total > 0
                                            AND least(m.good, m.total)::float8 / m.total < s.timeslice_target, false)
    FROM slo_slo s WHERE m.stale AND m.slo_id = ANY(%s) AND s.id = m.slo_id
"""


def fold_stale(slos: list[Slo]) -> tuple[int, int]:
    """Derive the stale minute rows of these request SLOs; returns (rows, SLOs with any)."""
    ids = [slo.pk for slo in slos]
    with transaction.atomic(), connection.cursor() as cursor:
        # Exclusive: no batch adds to a row between reading it and clearing its stale mark.
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", FOLD_LOCK)
        cursor.execute(_STALE_STARTS, [ids])
        stale = cursor.fetchall()
        if not stale:
            return 0, 0
        cursor.execute(_DERIVE_SLICES, [ids])
        _refresh_running_totals({slo_id: start for slo_id, start, _ in stale})
    return sum(count for _, _, count in stale), len(stale)


def ingest_new(slos: list[Slo], now: datetime, phases: dict[str, float] | None = None) -> tuple[int, int, int]:
    """Bring each SLO's minute rows up to date. Returns (rows written, SLOs with new data, stale
    rows derived); `phases` gets the seconds of the steps."""
    phases = phases if phases is not None else {}
    written = fresh = 0
    for slo in slos:
        if slo.watermark is None:
            rows = backfill(slo, now)
            written, fresh = written + rows, fresh + bool(rows)
    ratio = [slo for slo in slos if slo.sli_kind == SliKind.RATIO]
    for slo in ratio:  # few, and their source is per replica: one statement each
        query = ratio_query(slo)
        params = {**query.params, "slo_id": slo.pk, "start": floor_minute(slo.watermark - OVERLAP),
                  "end": floor_minute(now) + MINUTE}
        with transaction.atomic():
            rows = _execute(_UPSERT.format(counted=_ratio_range(query)), params)
            _refresh_running_totals({slo.pk: params["start"]})
        slo.watermark = max(slo.watermark, floor_minute(now))
        written, fresh = written + rows, fresh + bool(rows)
    # Request and quality SLIs: their rows were added to (by the usage pipeline, by eval runs).
    added = [slo for slo in slos if slo.sli_kind != SliKind.RATIO]
    if not added:
        return written, fresh, 0
    started = clock.perf_counter()
    stale_rows, stale_slos = fold_stale(added)
    phases["running_totals_s"] = clock.perf_counter() - started
    return written + stale_rows, fresh + stale_slos, stale_rows


# ---------------------------------------------------------------------------- window sums


def running_totals_at(probes: list[tuple[int, datetime]]) -> dict[tuple[int, datetime], Counts]:
    """Running totals of each (slo id, minute) probe: the last row at or before that minute."""
    if not probes:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT p.slo_id, p.minute, m.cum_good, m.cum_total, m.cum_bad_slices
            FROM unnest(%s::bigint[], %s::timestamptz[]) AS p(slo_id, minute)
            LEFT JOIN LATERAL (
                SELECT cum_good, cum_total, cum_bad_slices FROM slo_slominute s
                WHERE s.slo_id = p.slo_id AND s.minute <= p.minute ORDER BY s.minute DESC LIMIT 1
            ) m ON true
            """,
            [[slo_id for slo_id, _ in probes], [minute for _, minute in probes]],
        )
        return {(slo_id, minute): Counts(good or 0, total or 0, bad or 0)
                for slo_id, minute, good, total, bad in cursor.fetchall()}


@dataclass(frozen=True)
class Evaluation:
    """Everything one evaluation of one SLO at one moment found."""

    at: datetime
    window_start: datetime
    counts: Counts
    budget: Budget
    burn_rates: dict[str, float]
    verdicts: tuple[RuleVerdict, ...]
    time_to_exhaustion_s: float | None
    min_events: int = 0
    # minutes -> (burn rate, requests) over the windows a listener asked for (slo.signals.burn_windows)
    window_burns: dict[int, tuple[float, int]] = field(default_factory=dict)
    # Quality SLIs, in the cycle: the latest eval run against the floor, which alone pages (not a burn rate).
    quality: QualityVerdict | None = None

    @property
    def insufficient_traffic(self) -> bool:
        """Too few events in the budget window to judge (the SLO's min_requests)."""
        return not enough_events(self.counts.total, self.min_events)

    def firing(self, severity: str) -> list[RuleVerdict] | list[QualityVerdict]:
        if self.quality is not None:  # one run's score is judged on its own cases, whatever the traffic
            return [self.quality] if severity == Severity.PAGE and self.quality.below_floor else []
        # Each rule also guards its own long window; this holds the state and the alerts together
        # where a long window reaches before the budget window (a calendar week's first days).
        if self.insufficient_traffic:
            return []
        return [v for v in self.verdicts if v.rule.severity == severity and v.firing]


class WindowReader:
    """Plans the probes an SLO needs at a moment, then turns the running totals into an Evaluation."""

    def __init__(self, slo: Slo, at: datetime, extra_windows: set[int] | frozenset[int] = frozenset()):
        self.slo = slo
        self.at = at
        self.span = window_span(slo.window, at, slo.time_zone)
        self.current = self.span.current_minute
        self.rules = alert_rules(slo.window)
        lengths = set(BURN_WINDOWS.values())
        for rule in self.rules:
            lengths.update((rule.long_minutes, rule.short_minutes))
        self.extra_windows = sorted(extra_windows)
        self.lengths = sorted(lengths | set(extra_windows))

    def probes(self) -> list[tuple[int, datetime]]:
        minutes = {self.current, self.span.start - MINUTE}
        minutes.update(self.current - n * MINUTE for n in self.lengths)
        return [(self.slo.pk, minute) for minute in minutes]

    def evaluate(self, totals: dict[tuple[int, datetime], Counts]) -> Evaluation:
        slo = self.slo
        now_totals = totals[(slo.pk, self.current)]

        def over(minutes: int) -> Counts:
            return now_totals - totals[(slo.pk, self.current - minutes * MINUTE)]

        counts = now_totals - totals[(slo.pk, self.span.start - MINUTE)]
        if slo.budgeting == Budgeting.TIMESLICES:
            data_start = max(self.span.start, floor_minute(slo.backfilled_from or self.span.start))
            observed = max(0, (self.current - data_start) // MINUTE + 1)
            budget = timeslices_budget(counts, slo.objective, self.span, observed)
        else:
            budget = occurrences_budget(counts, slo.objective)

        def burn(minutes: int) -> float:
            return burn_rate(over(minutes), slo.objective, slo.budgeting, minutes)

        burn_rates = {name: burn(minutes) for name, minutes in BURN_WINDOWS.items()}
        verdicts = tuple(
            RuleVerdict(rule=rule, long_burn=burn(rule.long_minutes), short_burn=burn(rule.short_minutes),
                        long_events=over(rule.long_minutes).total, min_requests=slo.min_requests)
            for rule in self.rules
        )
        return Evaluation(
            at=self.at, window_start=self.span.start, counts=counts, budget=budget, burn_rates=burn_rates,
            verdicts=verdicts,
            time_to_exhaustion_s=time_to_exhaustion_s(budget.budget_remaining, burn_rates["1h"], self.span.period),
            min_events=slo.min_requests,
            window_burns={minutes: (burn(minutes), over(minutes).total) for minutes in self.extra_windows},
        )


def evaluate_at(moments: list[tuple[Slo, datetime]], windows: dict[int, set[int]] | None = None) -> list[Evaluation]:
    """Evaluate each SLO at its moment from the stored minute rows (also past moments, for charts);
    `windows`: extra burn windows (minutes) per SLO id."""
    readers = [WindowReader(slo, at, (windows or {}).get(slo.pk, frozenset())) for slo, at in moments]
    totals = running_totals_at([probe for reader in readers for probe in reader.probes()])
    return [reader.evaluate(totals) for reader in readers]


# ---------------------------------------------------------------------------- the cycle


def _save_statuses(pairs: list[tuple[Slo, Evaluation, str]], evaluated_at: datetime) -> None:
    rows = [
        SloStatus(
            slo=slo, sli=ev.budget.sli, good=ev.counts.good, total=ev.counts.total,
            budget_total=ev.budget.budget_total, budget_consumed=ev.budget.budget_consumed,
            budget_remaining=ev.budget.budget_remaining, burn_rates=ev.burn_rates,
            time_to_exhaustion_s=ev.time_to_exhaustion_s, state=state, window_start=ev.window_start,
            evaluated_at=evaluated_at,
        )
        for slo, ev, state in pairs
    ]
    SloStatus.objects.bulk_create(
        rows, update_conflicts=True, unique_fields=["slo"],
        update_fields=["sli", "good", "total", "budget_total", "budget_consumed", "budget_remaining", "burn_rates",
                       "time_to_exhaustion_s", "state", "window_start", "evaluated_at"],
    )


def _save_watermarks(slos: list[Slo]) -> None:
    """A NULL watermark in the row means slo_update redefined the SLI during this cycle and
    wants a back-fill: it is left NULL (the back-fill set its own in its transaction)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE slo_slo s SET watermark = u.watermark "
            "FROM unnest(%s::bigint[], %s::timestamptz[]) AS u(id, watermark) "
            "WHERE s.id = u.id AND s.watermark IS NOT NULL AND s.watermark IS DISTINCT FROM u.watermark",
            [[slo.pk for slo in slos], [slo.watermark for slo in slos]],
        )


def evaluate_slos(*, now: datetime | None = None, slo_ids: list[int] | None = None) -> CycleReport:
    """One evaluation cycle. Skipped (report.skipped) while another cycle holds the lock."""
    from alerts.services import alerts_sync

    report = CycleReport()
    started = clock.perf_counter()
    with try_advisory_lock(LockId.SLO_EVALUATION) as acquired:
        if not acquired:
            report.skipped = True
            return report
        with connection.cursor() as cursor:
            # The statements are index walks over a few rows, but their cost estimates (tables of
            # millions of rows) trip JIT compilation, which took longer than the work (0.8 s of 0.8 s).
            cursor.execute("SET jit = off")
        try:
            now = now or timezone.now()
            slos = list(Slo.objects.select_related("deployment").filter(**({"pk__in": slo_ids} if slo_ids else {})))
            report.slos = len(slos)

            phase = clock.perf_counter()
            report.minutes_upserted, report.slos_with_new_data, report.touched_keys = ingest_new(
                slos, now, report.phases)
            _save_watermarks(slos)
            report.phases["ingest_s"] = clock.perf_counter() - phase

            phase = clock.perf_counter()
            evaluations = with_verdicts(slos, evaluate_at([(slo, now) for slo in slos], signals.wanted_windows(slos)))
            report.evaluations = {slo.pk: ev for slo, ev in zip(slos, evaluations, strict=True)}
            report.phases["windows_s"] = clock.perf_counter() - phase

            phase = clock.perf_counter()
            changes = alerts_sync(pairs=list(zip(slos, evaluations, strict=True)), now=now)
            report.alerts_opened, report.alerts_updated, report.alerts_resolved = (
                changes.opened, changes.updated, changes.resolved)
            states = [
                (slo, ev, slo_state(ev.budget.budget_remaining, alert_firing=slo.pk in changes.firing_slo_ids,
                                    events=ev.counts.total, min_events=slo.min_requests))
                for slo, ev in zip(slos, evaluations, strict=True)
            ]
            _save_statuses(states, now)
            report.phases["alerts_status_s"] = clock.perf_counter() - phase
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET jit")
    report.seconds = clock.perf_counter() - started
    log.info("evaluate-slos: %s", report.as_dict())
    return report


def prune_minutes(*, now: datetime | None = None, keep: timedelta | None = None) -> int:
    """Delete minute rows older than `keep` (default INFEROPS_SLO_MINUTE_RETENTION_DAYS), except
    each SLO's newest row before the cut: window sums subtract the running total at or before a
    boundary, so that anchor must stay for the oldest windows to stay exact."""
    from django.conf import settings

    keep = keep or timedelta(days=settings.INFEROPS_SLO_MINUTE_RETENTION_DAYS)
    cutoff = floor_minute((now or timezone.now()) - keep)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            DELETE FROM slo_slominute m
            USING (SELECT slo_id, max(minute) AS anchor FROM slo_slominute WHERE minute < %s GROUP BY slo_id) a
            WHERE m.slo_id = a.slo_id AND m.minute < a.anchor
            """,
            [cutoff],
        )
        return cursor.rowcount
