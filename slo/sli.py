"""What counts as good and total for each SLI kind, as SQL over the rows the SLI comes from.

Request SLIs (availability, latency, goodput) judge each request on its own values, so a latency
verdict is the request's value against the threshold: exact for any threshold. The usage pipeline
judges each new event once, in Python (`request_verdict`); the same rules as SQL serve the
back-fill of a new or redefined SLO, which reads the stored events (`REQUEST_BACKFILL_SQL`).
Ratio SLIs read runtime_replicametricsminute, the scraped counters' per-minute deltas.

Classification of a request (the SLO contract):
- server failure: status >= 500, or error_kind shed / upstream_* / internal; counts as bad;
- client error: any other 4xx or error_kind (rate limits, auth, bad requests, disconnects) and
  a 503 `degraded` (shed on purpose by the degradation policy, which would otherwise keep up
  the burn that caused it): neither good nor bad, left out of the total;
- succeeded: everything else (status < 400 without an error kind).
A line of an offline batch (`batch_id` set) waits for idle capacity on purpose: availability
judges it like any request (a failed line is a failure), latency and goodput leave it out of
good and total alike, so interactive SLOs read the same with or without batch traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.gateway.contract import DEGRADED, SERVER_ERROR_KINDS, is_server_failure
from slo.choices import Scope, SliKind

# A server failure as SQL over an event row `e` (rollout analysis and charts use it too).
SERVER_FAILURE_SQL = (f"((e.status >= 500 AND e.error_kind IS DISTINCT FROM '{DEGRADED}') "
                      f"OR coalesce(e.error_kind IN ({', '.join(repr(k) for k in SERVER_ERROR_KINDS)}), false))")
_CLIENT_ERROR = f"(NOT {SERVER_FAILURE_SQL} AND (e.status >= 400 OR e.error_kind IS NOT NULL))"
SUCCEEDED_SQL = "(e.status < 400 AND e.error_kind IS NULL)"
INTERACTIVE_SQL = "(e.batch_id IS NULL)"  # not a line of an offline batch
_LATENCY = ("ttft_ms", "tpot_ms", "e2e_ms")
# Thresholds the SLO (row s) names: each must be met; a request lacking the value...
_MEASURED = " AND ".join(f"(s.{v} IS NULL OR e.{v} IS NOT NULL)" for v in _LATENCY)
_MET = " AND ".join(f"(s.{v} IS NULL OR e.{v} <= s.{v})" for v in _LATENCY)  # ...fails it (latency)
_MET_OR_NOT_APPLICABLE = " AND ".join(f"(s.{v} IS NULL OR e.{v} IS NULL OR e.{v} <= s.{v})" for v in _LATENCY)

# Request SLIs as SQL over an event (e), the SLO's row (s) and a deployment it covers (d), so one
# statement counts the minutes of many SLOs at once, each with its own kind and thresholds.
# Latency judges successful requests that measured every named value (failures count against
# availability instead); goodput counts every request that was the server's to serve, good when
# it succeeded and met each threshold (a value that does not apply, e.g. TPOT of a one-token
# answer, is met).
# Batch lines count for availability only (see above).
REQUEST_GOOD_SQL = (f"CASE s.sli_kind WHEN '{SliKind.AVAILABILITY}' THEN {SUCCEEDED_SQL} "
                    f"WHEN '{SliKind.LATENCY}' THEN {INTERACTIVE_SQL} AND {SUCCEEDED_SQL} AND {_MET} "
                    f"ELSE {INTERACTIVE_SQL} AND {SUCCEEDED_SQL} AND {_MET_OR_NOT_APPLICABLE} END")
REQUEST_TOTAL_SQL = (f"CASE s.sli_kind WHEN '{SliKind.LATENCY}' THEN {INTERACTIVE_SQL} AND {SUCCEEDED_SQL} "
                     f"AND {_MEASURED} WHEN '{SliKind.AVAILABILITY}' THEN NOT {_CLIENT_ERROR} "
                     f"ELSE {INTERACTIVE_SQL} AND NOT {_CLIENT_ERROR} END")
# d: the SLO's deployment, or every deployment of its model; e: their events (of its tenant).
COVERED_DEPLOYMENT_SQL = f"(d.id = s.deployment_id OR (s.scope = '{Scope.MODEL}' AND d.model_id = s.model_id))"
MATCHING_EVENT_SQL = f"e.deployment = d.name AND (s.scope <> '{Scope.TENANT}' OR e.tenant = s.tenant)"
# Every minute of one request SLO in [start, end) from the stored events: its back-fill.
REQUEST_BACKFILL_SQL = f"""
    SELECT s.id AS slo_id, date_trunc('minute', e.time) AS minute, count(*) FILTER (WHERE {REQUEST_GOOD_SQL}) AS good,
           count(*) FILTER (WHERE {REQUEST_TOTAL_SQL}) AS total
    FROM slo_slo s
    JOIN deployments_deployment d ON {COVERED_DEPLOYMENT_SQL}
    JOIN tenants_usageevent e ON {MATCHING_EVENT_SQL} AND e.time >= %(start)s AND e.time < %(end)s
    WHERE s.id = %(slo_id)s
    GROUP BY 1, 2
"""


@dataclass(frozen=True)
class RequestSli:
    """What judging a request needs of a request SLO (one row of the pipeline's SLO read)."""

    slo_id: int
    sli_kind: str
    tenant: str | None  # set for a tenant-scoped SLO: only that tenant's requests count
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None


def request_verdict(sli: RequestSli, event: dict) -> tuple[bool, bool]:
    """(good, counted) of one event under one request SLO: REQUEST_GOOD_SQL and REQUEST_TOTAL_SQL
    in Python, for the pipeline, which judges each new event once."""
    if sli.sli_kind != SliKind.AVAILABILITY and event.get("batch_id") is not None:
        return False, False  # a batch line: availability's alone (.get: hand-built events may lack it)
    status, kind = event["status"], event["error_kind"]
    succeeded = status < 400 and kind is None
    limits = ((sli.ttft_ms, event["ttft_ms"]), (sli.tpot_ms, event["tpot_ms"]), (sli.e2e_ms, event["e2e_ms"]))
    if sli.sli_kind == SliKind.LATENCY:
        counted = succeeded and all(limit is None or value is not None for limit, value in limits)
        return counted and all(limit is None or value <= limit for limit, value in limits), counted
    # Availability and goodput count what was the server's to serve (a client error is neither).
    counted = is_server_failure(status, kind) or not (status >= 400 or kind is not None)
    if sli.sli_kind == SliKind.AVAILABILITY:
        return succeeded, counted
    return succeeded and all(limit is None or value is None or value <= limit for limit, value in limits), counted


@dataclass(frozen=True)
class SliQuery:
    """SQL pieces for one ratio SLO: the source table, its time column, the scope filter and the
    good/total aggregates, with their parameters."""

    table: str
    time_column: str
    scope_sql: str
    good_sql: str
    total_sql: str
    params: dict


def _ratio_series_sql(series: str) -> str:
    if series == "requests":
        return "coalesce((SELECT sum(value::bigint) FROM jsonb_each_text(e.requests_by_reason)), 0)"
    return f"e.{series}"  # a column name from slo.choices.RATIO_SERIES, checked by Slo.clean()


def ratio_query(slo) -> SliQuery:
    from deployments.models import Deployment

    if slo.scope == Scope.MODEL:
        ids = list(Deployment.objects.filter(model_id=slo.model_id).values_list("pk", flat=True))
    else:
        ids = [slo.deployment_id]
    return SliQuery(
        table="runtime_replicametricsminute", time_column="start",
        scope_sql="e.deployment_id = ANY(%(deployment_ids)s)",
        good_sql=f"coalesce(sum({_ratio_series_sql(slo.ratio_good)}), 0)",
        total_sql=f"coalesce(sum({_ratio_series_sql(slo.ratio_total)}), 0)",
        params={"deployment_ids": ids},
    )
