"""Issue 39 end to end: SLOs become the engine's targets, and a request that cannot meet its TTFT is
refused with a 503, counted in the replica's /metrics and booked as `late` in the usage ledger.

Real parts: a replica process under `--scheduling-policy slo --slo-reject-late` started by a Celery
worker with beat (which reconciles, ingests usage and syncs the targets), a gateway process, a private
Redis and Postgres. No timing is asserted: a refusal is made certain with a 1 µs TTFT target, past
before the engine first sees the request, and a 60 s one is never missed.
"""

from __future__ import annotations

import httpx
import pytest

from deployments import services as deployment_services
from deployments.models import Replica
from registry import services as registry_services
from slo.services import slo_create, slo_update
from tenants import services as tenant_services
from tenants.ingest import ingest_usage
from tenants.models import UsageEvent
from tenants.publish import publish_keys
from tests.e2e.conftest import start_gateway, stop_stack
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ADMIN_TOKEN = "slo-scheduling-e2e"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def platform(private_redis, worker_env, tmp_path, make_user, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", ADMIN_TOKEN)
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    chat = deployment_services.deployment_create(
        name="chat", model=model, version=1, actor=actor,
        engine_args={"scheduling_policy": "slo", "slo_reject_late": True, "cpu_threads": 1})
    acme = tenant_services.tenant_create(name="acme", actor=actor)
    globex = tenant_services.tenant_create(name="globex", actor=actor)
    _, acme_key = tenant_services.key_create(tenant=acme, name="acme-app", actor=actor)
    _, globex_key = tenant_services.key_create(tenant=globex, name="globex-app", actor=actor)
    publish_keys()
    env = {**worker_env, "REDIS_URL": private_redis.url, "INFEROPS_ADMIN_TOKEN": ADMIN_TOKEN,
           "INFEROPS_SLO_EVALUATE_INTERVAL_S": "3600", "INFEROPS_USAGE_INGEST_INTERVAL_S": "1",
           "INFEROPS_SLO_TARGETS_INTERVAL_S": "1"}
    worker = start_worker(env, tmp_path, "worker")
    gateway = None
    try:
        gateway, base = start_gateway(private_redis.url, tmp_path / "spool")
        wait_until(lambda: ask(base, acme_key).status_code == 200, "chat to serve through the gateway", 120, 0.2,
                   ignore=(httpx.TransportError,))
        yield {"actor": actor, "chat": chat, "base": base, "acme": acme_key, "globex": globex_key,
               "replica": Replica.objects.get(deployment=chat, state="ready")}
    finally:
        stop_stack(worker, gateway)


def ask(base: str, key: str, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "chat", "max_tokens": 4, "stream": stream,
                            "messages": [{"role": "user", "content": "hi"}]})


def replica_targets(replica: Replica) -> dict:
    return httpx.get(f"{replica.url}/admin/slo-targets", headers=ADMIN, timeout=5).json()


def rejected_late(replica: Replica) -> float:
    text = httpx.get(f"{replica.url}/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith("inferops:slo_rejected_late_total"))
    return float(line.rsplit(" ", 1)[1])


def test_late_requests_are_refused_counted_and_booked_and_targets_follow_the_slo(platform):
    base, replica, chat = platform["base"], platform["replica"], platform["chat"]
    identity = dict(replica.identity)
    latency = slo_create(actor=platform["actor"], name="chat-latency", deployment=chat, sli_kind="latency",
                         ttft_ms=0.001, tpot_ms=500, objective=0.99)
    wait_until(lambda: replica_targets(replica)["ttft_ms"] == 0.001, "the SLO's targets on the running replica",
               30, 0.2)

    refused = [ask(base, platform["acme"]), ask(base, platform["acme"], stream=True), ask(base, platform["globex"])]
    for response in refused:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "slo_late" and int(response.headers["retry-after"]) >= 1
    assert rejected_late(replica) == 3

    def booked() -> int:
        ingest_usage(budget_s=5)
        return UsageEvent.objects.filter(deployment="chat", status=503, error_kind="late").count()

    wait_until(lambda: booked() == 3, "three late refusals in the usage ledger", 30, 0.2)

    # The SLO relaxed: the same replica (no restart) serves again.
    slo_update(slo=latency, actor=platform["actor"], ttft_ms=60000)
    wait_until(lambda: replica_targets(replica)["ttft_ms"] == 60000.0, "the new targets", 30, 0.2)
    assert ask(base, platform["acme"]).status_code == 200
    assert ask(base, platform["globex"], stream=True).status_code == 200

    # A tenant's own, tighter SLO reaches the engine through the gateway's header: only its requests are late.
    slo_create(actor=platform["actor"], name="acme-latency", scope="tenant", tenant="acme", deployment=chat,
               sli_kind="latency", ttft_ms=0.001, objective=0.99)
    wait_until(lambda: ask(base, platform["acme"]).status_code == 503, "acme's targets at the gateway", 30, 0.2)
    assert ask(base, platform["globex"]).status_code == 200
    replica.refresh_from_db()
    assert replica.state == "ready" and replica.identity == identity
