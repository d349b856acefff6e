"""Issue 28 end to end: a burning SLO degrades a deployment and recovery undoes it, by itself.

Real parts: replica processes (`inferops serve`, faults through their admin API), a gateway
process, a private Redis, Postgres, and a Celery worker with beat that reconciles (and so
publishes each new level in the routing table), ingests usage and publishes keys. The test runs
the evaluation cycles itself (beat's are pushed out to an hour), so it can count them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from alerts.models import Alert
from degradation import services as degradation_services
from degradation.models import DegradationState, LevelChange
from deployments import services as deployment_services
from deployments.models import Replica
from registry import services as registry_services
from slo.services import slo_create
from slo.tasks import evaluation_cycle
from tenants import services as tenant_services
from tenants.ingest import ingest_usage
from tenants.models import UsageEvent
from tenants.publish import publish_keys
from tests.e2e.conftest import start_gateway, stop_stack
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ADMIN_TOKEN = "degradation-game-day"
HIGH, LOW = 9, 1
ENTER, EXIT = 2.0, 1.0


class Load:
    """Streamed chat requests from one key in a loop; outcomes counted by (status, error code)."""

    def __init__(self, base: str, key: str, model: str = "chat", max_tokens: int = 4):
        self.base, self.key, self.model, self.max_tokens = base, key, model, max_tokens
        self.outcomes: Counter = Counter()
        self.retry_after: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                self.outcomes[self.once(client)] += 1
                time.sleep(0.1)

    def once(self, client: httpx.Client) -> tuple[int, str]:
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        try:
            with client.stream("POST", f"{self.base}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {self.key}"}) as response:
                text = "".join(response.iter_text())
                if response.status_code == 200:
                    return 200, "" if text.rstrip().endswith("[DONE]") else "cut"
                if "retry-after" in response.headers:
                    self.retry_after.add(response.headers["retry-after"])
                return response.status_code, str(json.loads(text)["error"]["code"])
        except httpx.HTTPError as exc:
            return 0, type(exc).__name__

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


@pytest.fixture
def platform(private_redis, worker_env, tmp_path, make_user, tiny_llama_dir, monkeypatch):
    """A `chat` deployment (and a `small` one) served by replicas the worker starts, two keys of
    different priorities, a gateway, and a TTFT SLO."""
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", ADMIN_TOKEN)
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    chat = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor)
    small = deployment_services.deployment_create(name="small", model=model, version=1, actor=actor)
    tenant = tenant_services.tenant_create(name="acme", actor=actor)
    _, high = tenant_services.key_create(tenant=tenant, name="interactive", actor=actor, priority=HIGH)
    _, low = tenant_services.key_create(tenant=tenant, name="batch", actor=actor, priority=LOW)
    publish_keys()
    env = {**worker_env, "REDIS_URL": private_redis.url, "INFEROPS_ADMIN_TOKEN": ADMIN_TOKEN,
           "INFEROPS_SLO_EVALUATE_INTERVAL_S": "3600", "INFEROPS_USAGE_INGEST_INTERVAL_S": "1"}
    worker = start_worker(env, tmp_path, "worker")
    gateway = None
    try:
        gateway, base = start_gateway(private_redis.url, tmp_path / "spool")
        for name in ("chat", "small"):
            wait_until(lambda name=name: Load(base, high, name).once(httpx.Client(timeout=30)) == (200, ""),
                       f"{name} to serve through the gateway", 120, 0.2)
        yield {"actor": actor, "chat": chat, "small": small, "base": base, "high": high, "low": low,
               "replica": Replica.objects.get(deployment=chat, state="ready")}
    finally:
        stop_stack(worker, gateway)


def set_fault(replica: Replica, ms: float) -> None:
    response = httpx.post(f"{replica.url}/admin/faults", json={"fault_ttft_ms": ms},
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
    assert response.status_code == 200, response.text


def cycle(deployment) -> DegradationState:
    """What beat does each minute (here every second or so): ingest, then evaluate (engine included)."""
    ingest_usage(budget_s=5)
    evaluation_cycle()
    return DegradationState.objects.get(deployment=deployment)


def test_a_burning_slo_sheds_low_priority_and_recovery_undoes_it(platform, api):
    chat, replica = platform["chat"], platform["replica"]
    slo_create(actor=None, name="chat-ttft", deployment=chat, sli_kind="latency", ttft_ms=500, objective=0.9,
               window="1d", min_requests=5)
    degradation_services.policy_save(
        deployment=chat, actor=platform["actor"], enabled=True, window_minutes=1, hold_s=10, slos=[],
        levels=[{"name": "shed-batch", "enter_burn_rate": ENTER, "exit_burn_rate": EXIT,
                 "actions": {"shed_below_priority": 5}}])
    with Load(platform["base"], platform["high"]) as high, Load(platform["base"], platform["low"]) as low:
        # Healthy traffic of both classes, at least the SLO's min_requests: the level stays 0.
        wait_until(lambda: min(high.outcomes[(200, "")], low.outcomes[(200, "")]) >= 5,
                   lambda: f"five answered requests of each class ({high.outcomes}, {low.outcomes})", 30, 0.1)
        assert cycle(chat).level == 0

        set_fault(replica, 1500)
        # A cycle about every second, as beat would run them (each minute): until level 1.
        cycles: list[DegradationState] = []

        def degraded() -> bool:
            cycles.append(cycle(chat))
            return cycles[-1].level == 1

        wait_until(degraded, lambda: f"level 1 (burn rates {cycles[-1].burn_rates})", 180, 1)
        saw_burn = next((index for index, state in enumerate(cycles)
                         if max(state.burn_rates.values(), default=0) >= ENTER), None)
        # One level per cycle, entered in the cycle that saw the burn, or the next.
        assert saw_burn is not None and len(cycles) - 1 - saw_burn <= 1, [state.burn_rates for state in cycles]

        # The worker's reconcile pass publishes the level; low priority is shed, high is served.
        served_high = high.outcomes[(200, "")]
        wait_until(lambda: low.outcomes[(503, "degraded")] >= 3, "low-priority requests to be shed", 30, 0.2)
        wait_until(lambda: high.outcomes[(200, "")] >= served_high + 3, "high-priority requests to be served", 30, 0.2)
        assert low.retry_after == {"10"}
        alert = Alert.objects.get(labels__alertname="DeploymentDegraded", labels__deployment="chat")
        assert alert.status == "firing" and alert.severity == "ticket"

        set_fault(replica, 0)
        # The burn leaves the 1-minute window, then the 10 s hold: a cycle about every second.
        wait_until(lambda: cycle(chat).level == 0, "level 0 once the fault is gone", 240, 1)
        served_low = low.outcomes[(200, "")]
        wait_until(lambda: low.outcomes[(200, "")] >= served_low + 3, "low-priority requests to be served again",
                   30, 0.2)

    # The high class never failed; the low class failed only by being shed.
    assert set(high.outcomes) == {(200, "")}, high.outcomes
    assert set(low.outcomes) <= {(200, ""), (503, "degraded")}, low.outcomes
    changes = list(LevelChange.objects.filter(deployment=chat).order_by("at"))
    assert [(c.from_level, c.to_level) for c in changes] == [(0, 1), (1, 0)]
    assert changes[0].burn_rates["chat-ttft"] >= ENTER and "entry rate 2" in changes[0].reason
    alert.refresh_from_db()
    assert alert.status == "resolved"
    timeline = api("viewer").get("/api/v1/deployments/chat/degradation/").json()["history"]
    assert [(entry["from"], entry["to"]) for entry in timeline] == [(1, 0), (0, 1)]
    # Shed requests are recorded, and left out of the SLI (they would keep the burn up).
    assert UsageEvent.objects.filter(deployment="chat", status=503, error_kind="degraded").exists()


def test_a_forced_level_caps_max_tokens_and_falls_back_to_another_deployment(platform):
    chat = platform["chat"]
    degradation_services.policy_save(
        deployment=chat, actor=platform["actor"], enabled=True, window_minutes=5, hold_s=60, slos=[],
        levels=[{"name": "lean", "enter_burn_rate": 5, "exit_burn_rate": 2,
                 "actions": {"max_tokens_cap": 3, "fallback": {"deployment": "small", "priorities": [LOW]}}}])
    degradation_services.override_set(deployment=chat, actor=platform["actor"], level=1,
                                      until=timezone.now() + timedelta(minutes=10), reason="drill")
    base = platform["base"]

    def ask(key: str) -> httpx.Response:
        return httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": "chat", "max_tokens": 20, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "count"}]})

    capped = wait_until(lambda: (r := ask(platform["high"])).headers.get("x-inferops-max-tokens-capped") and r,
                        "the gateway to apply level 1", 30, 0.2)
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 3
    assert capped.json()["model"] == "chat" and "x-inferops-fallback" not in capped.headers
    moved = ask(platform["low"])
    assert moved.status_code == 200 and moved.headers["x-inferops-fallback"] == "small"
    assert moved.json()["model"] == "small" and moved.json()["usage"]["completion_tokens"] == 3

    wait_until(lambda: ingest_usage(budget_s=5) is not None and UsageEvent.objects.filter(
        deployment="small", tenant="acme").exists(), "the fallback request in the usage ledger", 30, 0.2)
    degradation_services.override_set(deployment=chat, actor=platform["actor"], level=0,
                                      until=timezone.now() + timedelta(minutes=10), reason="drill over")
    wait_until(lambda: "x-inferops-degradation-level" not in ask(platform["low"]).headers,
               "the gateway to go back to level 0", 30, 0.2)
    assert ask(platform["low"]).json()["model"] == "chat"
