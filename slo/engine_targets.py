"""What the engine is promised: latency targets from SLOs, to the replicas and the gateways.

The built-in engine schedules each request for a TTFT and a TPOT target (docs/serving.md,
"Scheduling for SLOs"). Two sources feed it, both the tightest thresholds of latency and goodput
SLOs:

- a deployment's SLOs (scope deployment, or its model's) are pushed to every ready built-in
  replica of it (`POST /admin/slo-targets`), right after an SLO changes and on every beat tick, so a
  new or restarted replica has them within one tick and nothing needs a restart;
- a tenant's SLOs on a deployment are published to Redis (contract.SLO_TARGETS_KEY), and the
  gateway sends them with that tenant's requests as headers, which win on the replica.

vLLM replicas have no such API and are left alone.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict

import httpx
from django.db import transaction
from django.db.models import Q

from deployments.choices import Backend, ReplicaState
from deployments.models import Deployment, Replica
from inferops.redis_client import replace_table
from inferops.replica_admin import admin_headers
from runtime.gateway.contract import (
    SLO_TARGETS_CHANNEL,
    SLO_TARGETS_GENERATION_KEY,
    SLO_TARGETS_KEY,
    slo_targets_field,
)
from slo.choices import Scope, SliKind
from slo.models import Slo

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 3.0
LATENCY_KINDS = (SliKind.LATENCY, SliKind.GOODPUT)


def targets_for(slos) -> dict[str, float | None]:
    """The tightest TTFT and TPOT thresholds among the latency and goodput SLOs given (None where none
    sets one): a request that meets these meets every one of them."""
    found: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": []}
    for slo in slos:
        if slo.sli_kind not in LATENCY_KINDS:
            continue
        for name, values in found.items():
            value = getattr(slo, name)
            if value is not None and value > 0:
                values.append(float(value))
    return {name: min(values) if values else None for name, values in found.items()}


def deployment_targets(deployment: Deployment) -> dict[str, float | None]:
    return targets_for(Slo.objects.filter(
        Q(scope=Scope.DEPLOYMENT, deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id),
        sli_kind__in=LATENCY_KINDS))


def tenant_table() -> dict[str, str]:
    """SLO_TARGETS_KEY's fields: `<deployment>:<tenant>` -> JSON {ttft_ms, tpot_ms}."""
    grouped = defaultdict(list)
    for slo in Slo.objects.filter(scope=Scope.TENANT, sli_kind__in=LATENCY_KINDS).select_related("deployment"):
        grouped[(slo.deployment.name, slo.tenant)].append(slo)
    table = {}
    for (deployment, tenant), slos in grouped.items():
        targets = targets_for(slos)
        if any(value is not None for value in targets.values()):
            table[slo_targets_field(deployment, tenant)] = json.dumps(targets, sort_keys=True)
    return table


def publish_tenant_targets() -> int:
    """Replace the published table with the database's; returns how many entries it holds."""
    table = tenant_table()
    replace_table(SLO_TARGETS_KEY, SLO_TARGETS_GENERATION_KEY, SLO_TARGETS_CHANNEL, table, "slo-targets")
    return len(table)


def push_replica_targets(deployments=None) -> dict[str, int]:
    """POST each ready built-in replica its deployment's targets (null ones fall back to the engine's
    own). A replica that does not answer keeps what it had and gets them again next tick."""
    replicas = Replica.objects.filter(state=ReplicaState.READY, deployment__backend=Backend.BUILTIN)
    if deployments is not None:
        replicas = replicas.filter(deployment__in=deployments)
    by_deployment: dict[int, dict] = {}
    outcome = {"pushed": 0, "failed": 0}
    with httpx.Client(timeout=PUSH_TIMEOUT_S, headers=admin_headers()) as client:
        for replica in replicas.select_related("deployment"):
            if not replica.url:
                continue
            if replica.deployment_id not in by_deployment:
                by_deployment[replica.deployment_id] = deployment_targets(replica.deployment)
            try:
                response = client.post(f"{replica.url}/admin/slo-targets", json=by_deployment[replica.deployment_id])
                response.raise_for_status()
                outcome["pushed"] += 1
            except httpx.HTTPError as exc:
                outcome["failed"] += 1
                log.warning("could not set SLO targets on replica %s (%s): %s; next tick retries",
                            replica, replica.url, exc)
    return outcome


def sync_engine_targets(deployments=None) -> dict[str, int]:
    """Publish the tenant table and push every (or these) deployments' targets to their replicas."""
    try:
        entries = publish_tenant_targets()
    except Exception as exc:  # Redis down: the gateways keep their last copy; the next tick heals it
        log.warning("could not publish the tenant SLO targets (%s); the next tick retries", exc)
        entries = -1
    return {"tenant_entries": entries, **push_replica_targets(deployments)}


def sync_after_commit() -> None:
    """After an SLO write commits: tell replicas and gateways now rather than at the next tick."""
    from inferops.celery import enqueue

    def later():
        try:
            enqueue("slo.sync_engine_targets")
        except Exception:  # the broker being down must not fail the write; the beat tick catches up
            log.exception("could not enqueue the SLO target sync")

    transaction.on_commit(later)
