"""What counts as good and total for each SLI kind, as SQL over the rows the SLI comes from.

Request SLIs (availability, latency, goodput) read tenants_usageevent, one row per request, so a
latency verdict is the request's own value against the threshold: exact for any threshold.
Ratio SLIs read runtime_replicametricsminute, the scraped counters' per-minute deltas.

Classification of a request (the SLO contract):
- server failure: status >= 500, or error_kind shed / upstream_* / internal; counts as bad;
- client error: any other 4xx or error_kind (rate limits, auth, bad requests, disconnects):
  neither good nor bad, left out of the total;
- succeeded: everything else (status < 400 without an error kind).
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.choices import Scope, SliKind

SERVER_ERROR_KINDS = ("shed", "upstream_timeout", "upstream_error", "upstream_connect", "internal")
_SERVER_FAILURE = "(e.status >= 500 OR coalesce(e.error_kind = ANY(%(server_kinds)s), false))"
_CLIENT_ERROR = f"(NOT {_SERVER_FAILURE} AND (e.status >= 400 OR e.error_kind IS NOT NULL))"
_SUCCEEDED = "(e.status < 400 AND e.error_kind IS NULL)"


@dataclass(frozen=True)
class SliQuery:
    """SQL pieces for one SLO: the source table, its minute expression, the scope filter and the
    good/total aggregates, with their parameters."""

    table: str
    time_column: str
    scope_sql: str
    good_sql: str
    total_sql: str
    params: dict


def sli_query(slo, deployments: list[str] | None = None) -> SliQuery:
    """`deployments`: the names the SLO covers, when the caller already knows them."""
    if slo.sli_kind == SliKind.RATIO:
        return _ratio_query(slo)
    names = deployments if deployments is not None else slo.deployment_names()
    params: dict = {"server_kinds": list(SERVER_ERROR_KINDS), "deployments": names}
    scope = "e.deployment = ANY(%(deployments)s)"
    if slo.scope == Scope.TENANT:
        scope += " AND e.tenant = %(tenant)s"
        params["tenant"] = slo.tenant
    thresholds = slo.thresholds
    for name, value in thresholds.items():
        params[f"limit_{name}"] = value
    if slo.sli_kind == SliKind.AVAILABILITY:
        good, total = _SUCCEEDED, f"NOT {_CLIENT_ERROR}"
    elif slo.sli_kind == SliKind.LATENCY:
        # Only successful requests that measured every named value are judged on latency;
        # failures count against availability instead.
        measured = " AND ".join(f"e.{name} IS NOT NULL" for name in thresholds)
        met = " AND ".join(f"e.{name} <= %(limit_{name})s" for name in thresholds)
        good, total = f"{_SUCCEEDED} AND {met}", f"{_SUCCEEDED} AND {measured}"
    elif slo.sli_kind == SliKind.GOODPUT:
        # Every request that was the server's to serve; good when it succeeded and met each
        # threshold (a value that does not apply, e.g. TPOT of a one-token answer, is met).
        met = " AND ".join(f"(e.{name} IS NULL OR e.{name} <= %(limit_{name})s)" for name in thresholds)
        good, total = f"{_SUCCEEDED} AND {met}", f"NOT {_CLIENT_ERROR}"
    else:
        raise ValueError(f"unknown SLI kind {slo.sli_kind!r}")
    return SliQuery(
        table="tenants_usageevent", time_column="time", scope_sql=scope,
        good_sql=f"count(*) FILTER (WHERE {good})", total_sql=f"count(*) FILTER (WHERE {total})", params=params,
    )


def _ratio_series_sql(series: str) -> str:
    if series == "requests":
        return "coalesce((SELECT sum(value::bigint) FROM jsonb_each_text(e.requests_by_reason)), 0)"
    return f"e.{series}"  # a column name from slo.choices.RATIO_SERIES, checked by Slo.clean()


def _ratio_query(slo) -> SliQuery:
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
