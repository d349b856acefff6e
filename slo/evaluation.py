"""`evaluate-slos`: fold newly ingested events into per-minute SLI rows, then compute budgets,
burn rates and alerts for every SLO, at a cost that does not grow with stored history.

The scheme, and why it is exact and idempotent:
1. One read per cycle of the events ingested since the oldest SLO watermark minus OVERLAP
   (`ingested_at` is the ingesting transaction's start, so a slow transaction can commit rows
   older than what the last cycle saw; OVERLAP covers that). It returns the touched
   (deployment, tenant, minute) keys only.
2. For each SLO, the touched minutes in its scope are recomputed from all their events and
   upserted (not added): running it twice, or reading an event twice thanks to the overlap,
   gives the same rows.
3. Running totals (`cum_*`) are recomputed from the earliest touched minute on, starting from
   the row before it: late events cost as many rows as they are late, not the whole history.
4. A window's sums are the difference of two running totals, found by index probes ("the last
   row at or before t") for all SLOs and all windows in one query.
An SLO evaluated for the first time is back-filled from the stored events of the last
BACKFILL_LIMIT (the usage-event retention); `backfilled_from` says where its data begin.
Ratio SLIs re-read their scraped minutes from the watermark minus OVERLAP (the scraper updates
the current minute's row in place), the same recompute-and-upsert way.
"""

from __future__ import annotations

import logging
import time as clock
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from slo.budget import (
    BURN_WINDOWS,
    MINUTE,
    Budget,
    Counts,
    RuleVerdict,
    alert_rules,
    burn_rate,
    floor_minute,
    occurrences_budget,
    slo_state,
    time_to_exhaustion_s,
    timeslices_budget,
    window_span,
)
from slo.choices import Budgeting, Scope, SliKind
from slo.models import Slo, SloStatus
from slo.sli import SliQuery, sli_query

log = logging.getLogger(__name__)

OVERLAP = timedelta(minutes=2)
BACKFILL_LIMIT = timedelta(days=35)
# pg advisory lock keys: (namespace, 0) for the cycle, (namespace, slo id) per SLO.
LOCK_NAMESPACE = 0x510E


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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------------------- minute rows


def _upsert_minutes(slo: Slo, query: SliQuery, start: datetime, end: datetime,
                    only_minutes: list[datetime] | None = None) -> int:
    """Recompute the SLO's minutes in [start, end) (or just `only_minutes`) from the source rows
    and upsert them; then refresh the running totals from `start` on. Returns rows written."""
    minute_sql = f"date_trunc('minute', e.{query.time_column})"
    only = f" AND {minute_sql} = ANY(%(minutes)s)" if only_minutes is not None else ""
    target = slo.timeslice_target if slo.budgeting == Budgeting.TIMESLICES else None
    sql = f"""
        INSERT INTO slo_slominute (slo_id, minute, good, total, bad_slice, cum_good, cum_total, cum_bad_slices)
        SELECT %(slo_id)s, minute, least(good, total), total,
               coalesce(total > 0 AND least(good, total)::float8 / total < %(target)s, false), 0, 0, 0
        FROM (
            SELECT {minute_sql} AS minute, {query.good_sql} AS good, {query.total_sql} AS total
            FROM {query.table} e
            WHERE {query.scope_sql} AND e.{query.time_column} >= %(start)s AND e.{query.time_column} < %(end)s{only}
            GROUP BY 1
        ) counted
        ON CONFLICT (slo_id, minute) DO UPDATE
        SET good = EXCLUDED.good, total = EXCLUDED.total, bad_slice = EXCLUDED.bad_slice
    """
    params = {**query.params, "slo_id": slo.pk, "start": start, "end": end, "minutes": only_minutes,
              "target": target}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        written = cursor.rowcount
        if written:
            _refresh_running_totals(cursor, slo.pk, start)
    return written


def _refresh_running_totals(cursor, slo_id: int, start: datetime) -> None:
    cursor.execute(
        """
        WITH base AS (
            SELECT coalesce(max(cum_good), 0) AS good, coalesce(max(cum_total), 0) AS total,
                   coalesce(max(cum_bad_slices), 0) AS bad_slices
            FROM (SELECT cum_good, cum_total, cum_bad_slices FROM slo_slominute
                  WHERE slo_id = %(slo_id)s AND minute < %(start)s ORDER BY minute DESC LIMIT 1) previous
        ), running AS (
            SELECT id, sum(good) OVER w AS good, sum(total) OVER w AS total,
                   sum(bad_slice::int) OVER w AS bad_slices
            FROM slo_slominute WHERE slo_id = %(slo_id)s AND minute >= %(start)s
            WINDOW w AS (ORDER BY minute)
        )
        UPDATE slo_slominute m
        SET cum_good = base.good + running.good, cum_total = base.total + running.total,
            cum_bad_slices = base.bad_slices + running.bad_slices
        FROM running, base
        WHERE m.id = running.id
          AND (m.cum_good, m.cum_total, m.cum_bad_slices) IS DISTINCT FROM
              (base.good + running.good, base.total + running.total, base.bad_slices + running.bad_slices)
        """,
        {"slo_id": slo_id, "start": start},
    )


def _database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def backfill(slo: Slo, now: datetime, deployments: list[str] | None = None) -> int:
    """First evaluation: every stored source row of the last BACKFILL_LIMIT becomes minute rows."""
    query = sli_query(slo, deployments)
    read_at = _database_now()
    start = floor_minute(now - BACKFILL_LIMIT)
    written = _upsert_minutes(slo, query, start, floor_minute(now) + MINUTE)
    first = slo.minutes.order_by("minute").values_list("minute", flat=True).first()
    created = floor_minute(slo.created_at or now)
    slo.backfilled_from = min(first, created) if first else created
    slo.watermark = floor_minute(now) if slo.sli_kind == SliKind.RATIO else read_at
    Slo.objects.filter(pk=slo.pk).update(backfilled_from=slo.backfilled_from, watermark=slo.watermark)
    return written


@dataclass(frozen=True)
class TouchedKeys:
    """(deployment, tenant) -> {minute: newest ingested_at} of events ingested since a moment."""

    read_at: datetime
    keys: dict[tuple[str | None, str | None], dict[datetime, datetime]]

    @classmethod
    def read(cls, since: datetime, *, slo: Slo | None = None, deployments: list[str] | None = None) -> TouchedKeys:
        read_at = _database_now()
        scope, params = "", {"since": since}
        if slo is not None:  # one SLO alone (its first cycle after an API change, tests)
            query = sli_query(slo, deployments)
            scope, params = f" AND {query.scope_sql}", {**query.params, **params}
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT e.deployment, e.tenant, date_trunc('minute', e.time), max(e.ingested_at) "
                f"FROM tenants_usageevent e WHERE e.ingested_at > %(since)s{scope} GROUP BY 1, 2, 3",
                params,
            )
            keys: dict = defaultdict(dict)
            for deployment, tenant, minute, newest in cursor.fetchall():
                keys[(deployment, tenant)][minute] = newest
        return cls(read_at=read_at, keys=dict(keys))

    def minutes_for(self, slo: Slo, deployments: list[str]) -> list[datetime]:
        horizon = slo.watermark - OVERLAP
        minutes: set[datetime] = set()
        for (deployment, tenant), by_minute in self.keys.items():
            if deployment not in deployments or (slo.scope == Scope.TENANT and tenant != slo.tenant):
                continue
            minutes.update(minute for minute, newest in by_minute.items() if newest > horizon)
        return sorted(minutes)


def ingest_new(slo: Slo, now: datetime, touched: TouchedKeys | None, deployments: list[str] | None = None) -> int:
    """Fold what arrived since the SLO's watermark into its minute rows; returns rows written."""
    if slo.watermark is None:
        return backfill(slo, now, deployments)
    query = sli_query(slo, deployments)
    if slo.sli_kind == SliKind.RATIO:
        start = floor_minute(slo.watermark - OVERLAP)
        written = _upsert_minutes(slo, query, start, floor_minute(now) + MINUTE)
        slo.watermark = max(slo.watermark, floor_minute(now))
        return written
    if touched is None:
        touched = TouchedKeys.read(slo.watermark - OVERLAP, slo=slo, deployments=deployments)
    minutes = touched.minutes_for(slo, query.params["deployments"])
    written = 0
    if minutes:
        written = _upsert_minutes(slo, query, minutes[0], minutes[-1] + MINUTE, only_minutes=minutes)
    slo.watermark = max(slo.watermark, touched.read_at)
    return written


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

    def firing(self, severity: str) -> list[RuleVerdict]:
        return [v for v in self.verdicts if v.rule.severity == severity and v.firing]


class WindowReader:
    """Plans the probes an SLO needs at a moment, then turns the running totals into an Evaluation."""

    def __init__(self, slo: Slo, at: datetime):
        self.slo = slo
        self.at = at
        self.span = window_span(slo.window, at, slo.time_zone)
        self.current = self.span.current_minute
        self.rules = alert_rules(slo.window)
        lengths = set(BURN_WINDOWS.values())
        for rule in self.rules:
            lengths.update((rule.long_minutes, rule.short_minutes))
        self.lengths = sorted(lengths)

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
        )


def evaluate_at(moments: list[tuple[Slo, datetime]]) -> list[Evaluation]:
    """Evaluate each SLO at its moment from the stored minute rows (also past moments, for charts)."""
    readers = [WindowReader(slo, at) for slo, at in moments]
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


def _deployment_names(slos: list[Slo]) -> dict[int, list[str]]:
    from deployments.models import Deployment

    by_model: dict[int, list[str]] = defaultdict(list)
    model_ids = {slo.model_id for slo in slos if slo.scope == Scope.MODEL}
    for model_id, name in Deployment.objects.filter(model_id__in=model_ids).values_list("model_id", "name"):
        by_model[model_id].append(name)
    return {slo.pk: by_model[slo.model_id] if slo.scope == Scope.MODEL else [slo.deployment.name] for slo in slos}


def evaluate_slos(*, now: datetime | None = None, slo_ids: list[int] | None = None) -> CycleReport:
    """One evaluation cycle. Skipped (report.skipped) while another cycle holds the lock."""
    from alerts.services import alerts_sync

    report = CycleReport()
    started = clock.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, 0)", [LOCK_NAMESPACE])
        if not cursor.fetchone()[0]:
            report.skipped = True
            return report
    try:
        now = now or timezone.now()
        slos = list(Slo.objects.select_related("deployment").filter(**({"pk__in": slo_ids} if slo_ids else {})))
        report.slos = len(slos)
        names = _deployment_names(slos)  # one query for all, not one per SLO

        phase = clock.perf_counter()
        marks = [slo.watermark for slo in slos if slo.watermark and slo.sli_kind != SliKind.RATIO]
        touched = TouchedKeys.read(min(marks) - OVERLAP) if marks else None
        report.touched_keys = sum(len(v) for v in touched.keys.values()) if touched else 0
        for slo in slos:
            with transaction.atomic():
                written = ingest_new(slo, now, touched, names[slo.pk])
            report.minutes_upserted += written
            report.slos_with_new_data += bool(written)
        Slo.objects.bulk_update(slos, ["watermark"], batch_size=500)
        report.phases["ingest_s"] = clock.perf_counter() - phase

        phase = clock.perf_counter()
        evaluations = evaluate_at([(slo, now) for slo in slos])
        report.phases["windows_s"] = clock.perf_counter() - phase

        phase = clock.perf_counter()
        changes = alerts_sync(pairs=list(zip(slos, evaluations, strict=True)), now=now)
        report.alerts_opened, report.alerts_updated, report.alerts_resolved = (
            changes.opened, changes.updated, changes.resolved)
        states = [
            (slo, ev, slo_state(ev.budget.budget_remaining, alert_firing=slo.pk in changes.firing_slo_ids))
            for slo, ev in zip(slos, evaluations, strict=True)
        ]
        _save_statuses(states, now)
        report.phases["alerts_status_s"] = clock.perf_counter() - phase
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s, 0)", [LOCK_NAMESPACE])
    report.seconds = clock.perf_counter() - started
    log.info("evaluate-slos: %s", report.as_dict())
    return report
