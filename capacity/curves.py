"""Goodput curves: what hardware a replica runs on, what an hour of it costs, and storing and finding
the measured curves the planner reads.

A curve belongs to a version on some hardware at some engine arguments: the same weights serve a
different number of requests per second on an H100 than on four CPU cores, or with another batch
size. The hardware is named from what costing charges a replica for (costing.ledger.replica_resources),
so the planner's price and the ledger's agree on what one replica holds:

    gpu:H100x1    one H100 (GPUs decide the speed when a replica has any)
    cpu:4         four cores (a local replica's cpu_threads, else the host's cores; or resources.cpu)
    kubernetes:unsized   a replica whose resources say nothing of its size
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from types import SimpleNamespace

from django.db import transaction
from django.utils import timezone

from capacity.models import CapacityCurve
from costing.eval_costs import hourly_price
from costing.ledger import Held, PriceBook, replica_resources
from deployments.models import Deployment
from inferops.audit import actor_or_none, audit_record, snapshot
from registry.models import ModelVersion

HARDWARE_PATTERN = re.compile(
    r"^(?:gpu:(?P<gpu>[^\s:]+)x(?P<count>[1-9]\d*)|cpu:(?P<cpus>\d+(?:\.\d+)?)|[a-z0-9-]+:unsized)$")


def deployment_held(deployment: Deployment) -> Held:
    """What one replica of the deployment holds as it is configured now."""
    return replica_resources(deployment, SimpleNamespace(driver=deployment.driver, engine_args=deployment.engine_args))


def hardware_key(held: Held, driver: str) -> str:
    if held.gpu_count:
        return f"gpu:{held.gpu_type or 'unknown'}x{held.gpu_count}"
    if held.cpus:
        return f"cpu:{held.cpus.normalize():f}"
    return f"{driver}:unsized"


def deployment_hardware(deployment: Deployment) -> str:
    return hardware_key(deployment_held(deployment), deployment.driver)


def held_of_hardware(hardware: str) -> Held | None:
    """What a hardware key says a replica holds (its GPUs or its cores; nothing of memory), for pricing a
    plan asked for by version and hardware rather than by deployment. None for a key that names no size."""
    match = HARDWARE_PATTERN.match(hardware)
    if match is None or not (match["gpu"] or match["cpus"]):
        return None
    if match["gpu"]:
        return Held(match["gpu"], int(match["count"]), Decimal(0), Decimal(0), "from the hardware key")
    return Held("", 0, Decimal(match["cpus"]), Decimal(0), "from the hardware key")


def replica_usd_per_hour(held: Held, at: datetime | None = None, book: PriceBook | None = None) -> Decimal | None:
    """What one replica holding `held` costs per hour at `at` (default now), as costing prices an eval
    run's replica time: None when the price book prices nothing it holds."""
    return hourly_price(held, book or PriceBook.load(), at or timezone.now())


def validate_hardware(hardware: str) -> str | None:
    """None when the key reads as one `hardware_key` writes, else why not."""
    if HARDWARE_PATTERN.match(hardware):
        return None
    return "Name it as the planner does: gpu:<type>x<count> (gpu:H100x1), cpu:<cores> (cpu:4) or <driver>:unsized."


def curve_create(*, version: ModelVersion, hardware: str, engine_args: dict, deployment: str, source: str,
                 input_len: int, output_len: int, slo_ms: dict, points: list[dict], actor) -> CapacityCurve:
    """Store a measured curve (points by rising rate, already validated) and audit it."""
    with transaction.atomic():
        curve = CapacityCurve.objects.create(
            version=version, hardware=hardware, engine_args=engine_args, deployment=deployment, source=source,
            input_len=input_len, output_len=output_len, slo_ms=slo_ms, points=points,
            created_by=actor_or_none(actor))
        audit_record(actor=actor, action="capacity.curve.create", obj=curve, after=snapshot(curve))
    return curve


def newest_curve(version: ModelVersion, hardware: str, engine_args: dict | None = None
                 ) -> tuple[CapacityCurve | None, bool]:
    """The newest curve of the version on the hardware, at these engine arguments when given; else the
    newest at any: (curve, whether its engine arguments are the ones asked for)."""
    curves = CapacityCurve.objects.filter(version=version, hardware=hardware).order_by("-created_at", "-id")
    if engine_args is not None:
        exact = curves.filter(engine_args=engine_args).first()
        if exact is not None:
            return exact, True
    found = curves.first()
    return found, found is not None and (engine_args is None or found.engine_args == engine_args)
