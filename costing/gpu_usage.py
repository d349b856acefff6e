"""GPU-hours the ledger priced, per deployment version, and how busy the GPU telemetry says they were.

A replica's GPU-minutes in an hour are its cost rows' minutes times the GPUs its run held. The
hour's telemetry (the replica's hour row of scraped metrics, deployments/replicas/retention.py)
covers `gpu_minutes` of them with `gpu_devices` devices at a mean utilisation of `gpu_util_avg`:

    measured GPU-minutes = gpu_devices x gpu_minutes
    busy GPU-minutes     = gpu_util_avg / 100 x gpu_devices x gpu_minutes
    busy share           = busy / measured, over the minutes that had telemetry

A held GPU-minute no telemetry covers is "not measured", never idle: the busy share says nothing
about it.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

# Cost rows per replica and hour first: a replica restarted within an hour has two runs (two cost
# rows) but one hour of telemetry, which must be counted once.
_GPU_MINUTES = """
    WITH held AS (
        SELECT h.deployment, h.version, l.replica_id, h.hour, sum(h.minutes * l.gpu_count) AS minutes
        FROM costing_costhour h JOIN costing_replicalife l ON l.id = h.life_id
        WHERE h.hour >= %(start)s AND h.hour < %(end)s AND l.gpu_count > 0
        GROUP BY 1, 2, 3, 4
    )
    SELECT held.deployment, held.version, sum(held.minutes),
           coalesce(sum(m.gpu_devices * m.gpu_minutes), 0),
           coalesce(sum(m.gpu_util_avg / 100.0 * m.gpu_devices * m.gpu_minutes), 0),
           sum(greatest(held.minutes - coalesce(m.gpu_devices * m.gpu_minutes, 0), 0))
    FROM held
    LEFT JOIN runtime_replicametricshour m
        ON m.replica_id = held.replica_id AND m.start = held.hour AND m.gpu_minutes > 0
    GROUP BY 1, 2
"""


@dataclass
class GpuMinutes:
    held: int = 0  # GPU-minutes the ledger priced
    measured: float = 0.0  # GPU-minutes the telemetry covered
    busy: float = 0.0  # of those, busy: utilisation x devices x minutes
    not_measured: float = 0.0  # held GPU-minutes no telemetry covered


def gpu_minutes(start, end) -> dict[tuple[str, int], GpuMinutes]:
    """{(deployment, version): GpuMinutes} of the cost hours in [start, end)."""
    with connection.cursor() as cursor:
        cursor.execute(_GPU_MINUTES, {"start": start, "end": end})
        return {(deployment, version): GpuMinutes(int(held), float(measured), float(busy), float(unmeasured))
                for deployment, version, held, measured, busy, unmeasured in cursor.fetchall()}
