"""What counts as good and total for each SLI kind, as SQL over the rows the SLI comes from.

Request SLIs (availability, latency, goodput) read tenants_usageevent, one row per request, so a
latency verdict is the request's own value against the threshold: exact for any threshold.
Ratio SLIs read runtime_replicametricsminute, the scraped counters' per-minute deltas.

Classification of a request (the SLO contract):
- server failure: status >= 500, or error_kind shed / upstream_* / internal; counts as bad;
- client error: any other 4xx or error_kind (rate limits, auth, bad requests, disconnects) and
  a 503 `degraded` (shed on purpose by the degradation policy, which would otherwise keep up
  the burn that caused it): neither good nor bad, left out of the total;
- succeeded: everything else (status < 400 without an error kind).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.gateway.contract import DEGRADED, SERVER_ERROR_KINDS
from slo.choices import Scope, SliKind

# A server failure as SQL over an event row `e` (rollout analysis and charts use it too).
SERVER_FAILURE_SQL = (f"((e.status >= 500 AND e.error_kind IS DISTINCT FROM '{DEGRADED}') "
                      f"OR coalesce(e.error_kind IN ({', '.join(repr(k) for k in SERVER_ERROR_KINDS)}), false))")
_CLIENT_ERROR = f"(NOT {SERVER_FAILURE_SQL} AND (e.status >= 400 OR e.error_kind IS NOT NULL))"
SUCCEEDED_SQL = "(e.status < 400 AND e.error_kind IS NULL)"
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
REQUEST_GOOD_SQL = (f"CASE s.sli_kind WHEN '{SliKind.AVAILABILITY}' THEN {SUCCEEDED_SQL} "
                    f"WHEN '{SliKind.LATENCY}' THEN {SUCCEEDED_SQL} AND {_MET} "
                    f"ELSE {SUCCEEDED_SQL} AND {_MET_OR_NOT_APPLICABLE} END")
REQUEST_TOTAL_SQL = (f"CASE s.sli_kind WHEN '{SliKind.LATENCY}' THEN {SUCCEEDED_SQL} AND {_MEASURED} "
                     f"ELSE NOT {_CLIENT_ERROR} END")
# d: the SLO's deployment, or every deployment of its model; e: their events (of its tenant).
COVERED_DEPLOYMENT_SQL = f"(d.id = s.deployment_id OR (s.scope = '{Scope.MODEL}' AND d.model_id = s.model_id))"
MATCHING_EVENT_SQL = f"e.deployment = d.name AND (s.scope <> '{Scope.TENANT}' OR e.tenant = s.tenant)"


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
