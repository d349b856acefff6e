"""The SLO side of the usage pipeline (inferops/usage_pipeline.py): each new event judged once.

In the ingest transaction of a batch, every event is judged against each request SLO that covers
it (slo.sli.request_verdict). The verdicts
- are added into the SLO's minute rows by event time (`good = good + n`), so a late event lands
  in its own minute, exactly, however late; the rows are marked stale and the next evaluation
  cycle derives their timeslice verdict and running totals (slo/evaluation.py);
- set `slo_compliant` on the event: it succeeded and no latency or goodput SLO judged it bad,
  which costing reads instead of judging again. Those SLOs never judge a line of an offline batch
  (slo/sli.py), so a batch line is compliant when it succeeded.
Only SLOs already back-filled (watermark set) are added into: a new or redefined SLO gets its
minutes from the back-fill. FOLD_LOCK orders the two: a batch holds it shared, the back-fill and
the running-totals step exclusively, so a back-fill sees every batch committed before it and
every later batch sees the back-filled SLO.
"""

from __future__ import annotations

from collections import defaultdict

from inferops.locks import LockId
from slo.choices import Scope, SliKind
from slo.sli import COVERED_DEPLOYMENT_SQL, RequestSli, request_verdict

# Key 1 of the evaluation's namespace: the SLO minute rows being written.
FOLD_LOCK = (int(LockId.SLO_EVALUATION), 1)
JUDGED_FOR_COST = frozenset({SliKind.LATENCY, SliKind.GOODPUT})

# The request SLOs (not ratio or quality: no request counts for those) covering these deployments,
# locked FOR KEY SHARE so that an SLO redefined or deleted meanwhile waits for this batch's commit
# (and its stale minutes are dropped after it).
_COVERING = f"""
    SELECT s.id, d.name, s.sli_kind, CASE WHEN s.scope = '{Scope.TENANT}' THEN s.tenant END,
           s.ttft_ms, s.tpot_ms, s.e2e_ms, s.watermark IS NOT NULL
    FROM slo_slo s JOIN deployments_deployment d ON {COVERED_DEPLOYMENT_SQL}
    WHERE d.name = ANY(%s) AND s.sli_kind NOT IN ('{SliKind.RATIO}', '{SliKind.QUALITY}')
    FOR KEY SHARE OF s
"""
_ADD_MINUTES = """
    INSERT INTO slo_slominute (slo_id, minute, good, total, bad_slice, cum_good, cum_total, cum_bad_slices, stale)
    SELECT slo_id, to_timestamp(minute), good, total, false, 0, 0, 0, true
    FROM unnest(%b::int8[], %b::float8[], %b::int8[], %b::int8[]) AS batch(slo_id, minute, good, total)
    ON CONFLICT (slo_id, minute) DO UPDATE
    SET good = slo_slominute.good + EXCLUDED.good, total = slo_slominute.total + EXCLUDED.total, stale = true
"""


def fold_events(cursor, events: list[dict]) -> None:
    """Judge the batch's new events and add the verdicts into the SLO minute rows (see above)."""
    cursor.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", FOLD_LOCK)
    deployments = sorted({event["deployment"] for event in events if event["deployment"] is not None})
    covering: dict[str, list[tuple[RequestSli, bool]]] = defaultdict(list)
    if deployments:
        cursor.execute(_COVERING, [deployments])
        for slo_id, deployment, kind, tenant, ttft, tpot, e2e, counted in cursor.fetchall():
            covering[deployment].append((RequestSli(slo_id, kind, tenant, ttft, tpot, e2e), counted))
    minutes: dict[tuple[int, float], list[int]] = {}
    for event in events:
        compliant = event["status"] < 400 and event["error_kind"] is None
        for sli, counted in covering.get(event["deployment"], ()):
            if sli.tenant is not None and event["tenant"] != sli.tenant:
                continue
            good, total = request_verdict(sli, event)
            if total and not good and sli.sli_kind in JUDGED_FOR_COST:
                compliant = False
            if counted and total:
                key = (sli.slo_id, event["time"] // 60 * 60)
                sums = minutes.get(key)
                if sums is None:
                    sums = minutes[key] = [0, 0]
                sums[0] += good
                sums[1] += 1
        event["slo_compliant"] = compliant
    add_minutes(cursor, minutes)


def add_minutes(cursor, minutes: dict[tuple[int, float], list[int]]) -> None:
    """Add {(slo id, minute as Unix seconds): [good, total]} into the minute rows, marked stale for the
    next cycle to derive. The caller holds FOLD_LOCK shared (a quality SLO's eval runs add here too)."""
    if minutes:
        keys = sorted(minutes)  # one lock order for concurrent batches
        cursor.execute(_ADD_MINUTES, [[k[0] for k in keys], [k[1] for k in keys],
                                      [minutes[k][0] for k in keys], [minutes[k][1] for k in keys]])
