"""Cold starts: what each replica start cost, phase by phase, for the API, the page and /metrics.

A start's row (`ReplicaStart`) is made by the reconcile loop when it asks the driver for a process,
and gets `ready_at` when /health first answers 200 there. The other phases come from the replica's
own /metrics (`process_start_time_seconds`, `inferops:weights_loaded_time_seconds`,
`inferops:first_token_time_seconds`): the scraper fills them on its next cycle, and
`record_cold_start()` at once, for a caller that knows the first answer just left (the wake path).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable

import httpx

from deployments.models import Replica, ReplicaStart
from deployments.replicas.scraping import MetricsParseError, fill_cold_starts, metrics_url, parse_metrics

log = logging.getLogger(__name__)

PHASES = ("process", "weights_loaded", "ready", "first_token")
CAUSES = ("scale", "restart", "from_zero")


def record_cold_start(replica: Replica, *, timeout_s: float = 2.0) -> ReplicaStart | None:
    """Read one replica's /metrics now and fill the phases its latest start still lacks.

    Returns that start as stored afterwards, or None when the replica has none or its /metrics could
    not be read (logged; the scraper fills the phases on its next cycle anyway)."""
    if not replica.url:
        return latest_start(replica)
    try:
        response = httpx.get(metrics_url(replica.url), timeout=timeout_s, trust_env=False)
        response.raise_for_status()
        sample = parse_metrics(response.text)
    except (httpx.HTTPError, MetricsParseError) as exc:
        log.info("cold start of replica %s not recorded now: %s", replica.pk, exc)
        sample = None
    if sample is not None:
        fill_cold_starts({replica.pk: [sample]})
    return latest_start(replica)


def latest_start(replica: Replica) -> ReplicaStart | None:
    return replica.starts.order_by("-started_at", "-id").first()


def latest_starts(replica_ids: Iterable[int]) -> dict[int, ReplicaStart]:
    """Each replica's latest start, in one query."""
    rows = (ReplicaStart.objects.filter(replica_id__in=list(replica_ids))
            .order_by("replica_id", "-started_at", "-id").distinct("replica_id"))
    return {start.replica_id: start for start in rows}


def summary(starts: Iterable[ReplicaStart]) -> dict[str, dict]:
    """Median and max seconds of each phase over the starts that did not fail, each phase over those
    that reached it (or reported it): {phase: {"count", "median", "max"}}."""
    done = [start.seconds() for start in starts if not start.failed]
    result = {}
    for phase in PHASES:
        values = [seconds[phase] for seconds in done if seconds[phase] is not None]
        result[phase] = {"count": len(values),
                         "median": round(statistics.median(values), 3) if values else None,
                         "max": round(max(values), 3) if values else None}
    return result


def rounded(start: ReplicaStart) -> dict[str, float | None]:
    """The start's seconds to the millisecond."""
    return {phase: None if value is None else round(value, 3) for phase, value in start.seconds().items()}
