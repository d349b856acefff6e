"""Stable vs candidate over a rollout's time span, in fixed buckets, for the rollout page's charts.

One SQL statement over the usage ledger: each event counts for the track of the replica that
served it (candidate: a replica of the candidate's spec, `CANDIDATE_REPLICA_SQL`; stable: any
other replica of the deployment), and an attempt a replica failed before the gateway
retried the request elsewhere (`failed_replica`) counts as a failed attempt of that replica's
track, so a candidate's errors show even when the retry hid them from the client. Figures
match the rollout's analysis (slo/rollout_gate.py): latency percentiles over the attempts
that were not server failures, error rate = failed attempts / attempts. Requests to the
deployment's preview route (`<name>--preview`, served by the candidate alone) count too, so a
blue-green's smoke tests show before the switch; the analysis judges the main route only.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.db import connection

from deployments.rollouts.gate import CANDIDATE_REPLICA_SQL, candidate_params, gate
from runtime.gateway.contract import PREVIEW_SUFFIX

TRACKS = ("stable", "candidate")
DEFAULT_BUCKET_S = 10
# A long rollout (a pause until promoted, left for a day) widens the buckets to stay this many.
MAX_BUCKETS = 1440

# Each event gives one attempt by the replica that served it and, when an earlier replica failed
# it, one failed attempt by that replica (no latency: the client never saw it). Latency is the
# interactive requests' alone: an offline batch's lines (batch_id set) wait by design.
def series_sql() -> str:
    return f"""
    SELECT date_bin(make_interval(secs => %(bucket)s), e.time, %(start)s) AS bucket,
           CASE WHEN {CANDIDATE_REPLICA_SQL} THEN 'candidate' ELSE 'stable' END AS track,
           count(*) FILTER (WHERE NOT a.retried) AS requests,
           count(*) AS attempts,
           count(*) FILTER (WHERE a.failed) AS errors,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY a.ttft_ms) FILTER (WHERE NOT a.failed AND e.batch_id IS NULL)
               AS ttft_p95,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY a.tpot_ms) FILTER (WHERE NOT a.failed AND e.batch_id IS NULL)
               AS tpot_p95
    FROM tenants_usageevent e
    CROSS JOIN LATERAL (VALUES
        (e.replica, false, {gate().server_failure_sql}, e.ttft_ms, e.tpot_ms),
        (e.failed_replica, true, true, NULL::double precision, NULL::double precision)
    ) AS a(replica, retried, failed, ttft_ms, tpot_ms)
    JOIN runtime_replica r ON r.id = a.replica AND r.deployment_id = %(deployment_id)s
    WHERE e.deployment IN (%(deployment)s, %(preview)s) AND e.time >= %(start)s AND e.time < %(end)s
    GROUP BY 1, 2
"""


def bucket_seconds(start: datetime, end: datetime) -> int:
    """10 s, or a wider multiple of 10 s when the span would need more than MAX_BUCKETS."""
    span = max(0.0, (end - start).total_seconds())
    return max(DEFAULT_BUCKET_S, math.ceil(span / MAX_BUCKETS / DEFAULT_BUCKET_S) * DEFAULT_BUCKET_S)


def _empty(n: int) -> dict:
    return {"requests": [0] * n, "errors": [0] * n, "error_rate": [None] * n,
            "ttft_p95_ms": [None] * n, "tpot_p95_ms": [None] * n}


def rollout_series(rollout, start: datetime, end: datetime, bucket_s: int | None = None) -> dict:
    """Per bucket of [start, end) and per track: requests, errors, error rate, TTFT p95, TPOT p95.

    Returns {"bucket_s", "time": [bucket starts], "stable": {...}, "candidate": {...}} where every
    list has one entry per bucket (error rate and percentiles None where the track had no attempt),
    so charts show gaps where a track served nothing.
    """
    bucket_s = bucket_s or bucket_seconds(start, end)
    n = max(1, math.ceil((end - start).total_seconds() / bucket_s))
    times = [start + timedelta(seconds=i * bucket_s) for i in range(n)]
    out = {"bucket_s": bucket_s, "time": times, **{track: _empty(n) for track in TRACKS}}
    params = {"bucket": bucket_s, "start": start, "end": end, **candidate_params(rollout),
              "deployment": rollout.deployment.name, "preview": rollout.deployment.name + PREVIEW_SUFFIX,
              "deployment_id": rollout.deployment_id}
    with connection.cursor() as cursor:
        cursor.execute(series_sql(), params)
        rows = cursor.fetchall()
    for bucket, track, requests, attempts, errors, ttft, tpot in rows:
        i = round((bucket - start).total_seconds() / bucket_s)
        if not 0 <= i < n:
            continue
        series = out[track]
        series["requests"][i] = requests
        series["errors"][i] = errors
        series["error_rate"][i] = round(errors / attempts, 4) if attempts else None
        series["ttft_p95_ms"][i] = None if ttft is None else round(ttft, 2)
        series["tpot_p95_ms"][i] = None if tpot is None else round(tpot, 2)
    return out
