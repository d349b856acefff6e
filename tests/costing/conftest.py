"""Fixtures for costing: deployments with replica rows (no process runs: the rows stand for
them), usage written through the real ingest path, and prices."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from itertools import count

import pytest

from costing import services
from deployments.models import Deployment, Replica
from registry.models import RegisteredModel
from tenants.ingest import parse_event, store_events
from tests.deployments.conftest import make_version

T0 = datetime(2026, 3, 10, 10, 0, tzinfo=UTC)
_ids = count(1)


def at(hours: float = 0, minutes: float = 0, base: datetime = T0) -> datetime:
    from datetime import timedelta

    return base + timedelta(hours=hours, minutes=minutes)



def make_deployment(name: str, *, resources: dict | None = None, engine_args: dict | None = None,
                    versions: int = 1, model: str | None = None) -> Deployment:
    registered, _ = RegisteredModel.objects.get_or_create(name=model or f"{name}-model", task="generate")
    made = [make_version(registered, n) for n in range(1, versions + 1)]
    return Deployment.objects.create(name=name, model=registered, version=made[0], resources=resources or {},
                                     engine_args=engine_args or {})


def make_replica(deployment: Deployment, *, started_at: datetime, state: str = "ready", version: int = 1,
                 node: str = "node-a", stopped_at: datetime | None = None, engine_args: dict | None = None,
                 updated_at: datetime | None = None) -> Replica:
    replica = Replica.objects.create(
        deployment=deployment, version=deployment.model.versions.get(number=version), node=node, state=state,
        started_at=started_at, stopped_at=stopped_at, engine_args=engine_args or deployment.engine_args)
    if updated_at is not None:
        Replica.objects.filter(pk=replica.pk).update(updated_at=updated_at)
        replica.refresh_from_db()
    return replica


def usage(deployment: str, tenant: str, time: datetime, *, prompt: int, completion: int, version: int = 1,
          ttft_ms: float = 100.0, tpot_ms: float = 10.0, e2e_ms: float = 500.0, status: int = 200,
          error_kind: str | None = None, requests: int = 1, batch_id: str | None = None) -> int:
    """Events as the gateway reports them (or, with `batch_id`, as the batch runner reports an offline
    batch's lines), stored by the usage ledger's own ingest."""
    events = []
    for i in range(requests):
        events.append(parse_event(json.dumps({
            "request_id": f"req-{next(_ids)}", "time": time.timestamp() + i * 0.001, "tenant": tenant,
            "key_prefix": "abcd1234", "deployment": deployment, "version": version, "endpoint": "chat",
            "prompt_tokens": prompt, "completion_tokens": completion, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms,
            "e2e_ms": e2e_ms, "status": status, "error_kind": error_kind, "batch_id": batch_id,
            "priority": -1000 if batch_id else 0})))
    return store_events(events)


def price(resource: str, usd: str, effective_from: datetime, tier: str = "on-demand", **kwargs):
    return services.price_create(resource=resource, usd_per_hour=Decimal(usd), effective_from=effective_from,
                                 tier=tier, actor=None, **kwargs)


@pytest.fixture(autouse=True)
def _costing_settings(settings):
    settings.INFEROPS_COST_LOCAL_CPUS = 4
    settings.INFEROPS_COST_PROMPT_WEIGHT = 1
    settings.INFEROPS_COST_COMPLETION_WEIGHT = 4
    settings.CELERY_TASK_ALWAYS_EAGER = False
