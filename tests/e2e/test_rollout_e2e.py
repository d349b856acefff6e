"""Issues 7 and 28 end to end: rollouts with real replica processes, a real gateway and load through it,
and the platform's own rollback of a version that turns bad during its watch after success.

Real parts: `inferops serve` replicas (tiny checkpoint), the gateway process on a private Redis,
usage ingestion, SLO evaluation, and in the last test a real Celery worker (with beat) that is
SIGKILLed mid-rollout. Elsewhere the worker's two periodic jobs (reconcile passes and usage
ingestion) run in a thread of the test, calling the same functions, so each case is observable.

Each case prints its timeline (when the candidate got traffic, when a bad one was detected, when
traffic was back on stable); bench/README.md ("Rollouts") records a run of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import datetime, timedelta

import httpx
import openai
import pytest
from django.db import connection
from django.utils import timezone

from alerts.models import Alert
from deployments import services as deployment_services
from deployments.models import Replica, Rollout
from deployments.replicas import routing
from deployments.replicas.drivers.local import LocalProcessDriver
from deployments.replicas.reconcile import reconcile_deployment
from deployments.rollouts import services as rollouts
from inferops.api import Conflict
from registry import services as registry_services
from slo.evaluation import evaluate_slos
from slo.models import SloStatus
from slo.services import slo_create
from tenants import services as tenant_services
from tenants.ingest import ingest_usage
from tenants.models import UsageEvent
from tenants.publish import publish_keys
from tests.deployments.test_reconcile import all_ready, reconcile_until
from tests.e2e.conftest import gateway_client
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ADMIN_TOKEN = "rollout-game-day"
# How long gateways may route by the previous table after a change (pub/sub, else a 1 s poll).
PROPAGATION = timedelta(seconds=1.5)


class Load:
    """Streamed chat requests through the gateway from two threads until stopped; every outcome kept."""

    def __init__(self, client: openai.OpenAI, model: str = "chat"):
        self.client, self.model = client, model
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(2)]

    def run(self):
        while not self.stop.is_set():
            try:
                for _chunk in self.client.chat.completions.create(
                        model=self.model, max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]):
                    pass
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                self.failures.append(repr(exc))
            time.sleep(0.05)

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


class ControlLoop:
    """What the worker's beat does for a rollout: reconcile passes and usage ingestion, every 0.5 s."""

    def __init__(self, deployment):
        self.deployment = deployment
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.errors: list[str] = []

    def run(self):
        try:
            while not self.stop.is_set():
                try:
                    ingest_usage(budget_s=2)
                    reconcile_deployment(self.deployment.pk)
                except Exception as exc:  # noqa: BLE001 - surfaced by the test
                    self.errors.append(repr(exc))
                time.sleep(0.5)
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def platform(private_redis, tmp_path, settings, monkeypatch, make_user, tiny_llama_dir):
    """`chat` on v1 (one ready replica), v2 registered, a tenant key limited to `chat`, a gateway."""
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 1, "health_timeout_s": 1}
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", ADMIN_TOKEN)
    # The control loop of each test runs the passes; queued Celery tasks would need a worker.
    monkeypatch.setattr(deployment_services, "request_reconcile", lambda deployment: None)
    monkeypatch.setattr(rollouts, "request_reconcile", lambda deployment: None)
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    for _ in range(2):
        registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor)
    tenant = tenant_services.tenant_create(name="acme", actor=actor)
    _, key = tenant_services.key_create(tenant=tenant, name="ci", actor=actor, deployments=["chat"])
    publish_keys()
    reconcile_until(deployment, all_ready(1))
    gateway, base, client = gateway_client(private_redis.url, tmp_path / "spool", key)
    yield {"deployment": deployment, "client": client, "actor": actor, "redis": private_redis, "tmp": tmp_path,
           "model": model}
    if gateway.poll() is None:
        os.killpg(gateway.pid, signal.SIGKILL)
    for replica in Replica.objects.all():
        LocalProcessDriver().kill(replica)


def wait_rollout(rollout: Rollout, statuses: set[str], timeout: float) -> Rollout:
    def done():
        rollout.refresh_from_db()
        return rollout.status in statuses

    wait_until(done, lambda: f"rollout {rollout.pk} to become {statuses} (it is {rollout.status}: {rollout.message})",
               timeout, 0.2)
    return rollout


def event_time(rollout: Rollout, name: str) -> datetime:
    return datetime.fromisoformat(next(e["at"] for e in rollout.timeline if e["event"] == name))


def served_by(replica_ids, after: datetime) -> int:
    return UsageEvent.objects.filter(replica__in=list(replica_ids), time__gt=after).count()


def load_goes_on(since: datetime, requests: int = 10) -> None:
    """Wait until `requests` requests of the load started after `since` + PROPAGATION and reached the
    usage ledger (the control loop ingests), so that who served them, checked next, says something."""
    after = since + PROPAGATION
    wait_until(lambda: UsageEvent.objects.filter(deployment="chat", time__gt=after).count() >= requests,
               f"{requests} requests started after {after:%H:%M:%S.%f}", 60, 0.2)


def test_good_canary_is_promoted_through_every_step(platform):
    client, deployment = platform["client"], platform["deployment"]
    with Load(client) as load, ControlLoop(deployment) as loop:
        rollout = rollouts.rollout_create(
            deployment=deployment, actor=platform["actor"], version=2,
            steps=[{"set_weight": 50}, {"analysis": {"duration": "12s", "min_requests": 8}}])
        wait_rollout(rollout, {"succeeded", "aborted"}, 180)
        load_goes_on(timezone.now())  # no request fails once the old version is gone either
    assert rollout.status == "succeeded", rollout.message
    assert load.failures == [] and load.ok > 20 and loop.errors == []
    candidate_ids = list(rollout.replicas.values_list("pk", flat=True))
    assert served_by(candidate_ids, rollout.created_at) > 0
    deployment.refresh_from_db()
    assert deployment.version.number == 2 and deployment.model.aliases.get(name="champion").version.number == 2
    passed = rollout.measurements.get(verdict="pass")
    weighted, succeeded = event_time(rollout, "weight"), event_time(rollout, "succeeded")
    print(f"timeline good canary: 50% on the candidate {(weighted - rollout.created_at).total_seconds():.1f}s after "
          f"creation (warm first), analysis passed on {passed.candidate['requests']} candidate / "
          f"{passed.stable['requests']} stable requests, succeeded {(succeeded - weighted).total_seconds():.1f}s "
          f"later; {load.ok} requests, {len(load.failures)} failed")


@pytest.mark.parametrize("fault", [{"fault_error_rate": 0.6}, {"fault_ttft_ms": 400}], ids=["errors", "latency"])
def test_bad_candidate_is_aborted_and_rolled_back_with_no_failed_request(platform, fault):
    client, deployment = platform["client"], platform["deployment"]
    slo_create(actor=platform["actor"], name="chat-ttft", scope="deployment", deployment=deployment,
               sli_kind="goodput", ttft_ms=250, objective=0.95, window="1d", budgeting="occurrences")
    with Load(client) as load, ControlLoop(deployment) as loop:
        rollout = rollouts.rollout_create(
            deployment=deployment, actor=platform["actor"], engine_args=fault,
            steps=[{"set_weight": 50}, {"analysis": {"duration": "5m", "min_requests": 8}}, {"set_weight": 100}])
        wait_rollout(rollout, {"succeeded", "aborted"}, 240)
        load_goes_on(timezone.now())  # on stable after the rollback
    assert rollout.status == "aborted" and "chat-ttft burn rate" in rollout.message, rollout.message
    assert load.failures == [], load.failures[:3]
    assert loop.errors == []
    aborted, weighted = event_time(rollout, "aborted"), event_time(rollout, "weight")
    candidate_ids = list(rollout.replicas.values_list("pk", flat=True))
    ingest_usage(budget_s=5)
    last_on_candidate = (UsageEvent.objects.filter(replica__in=candidate_ids).order_by("-time")
                         .values_list("time", flat=True).first())
    assert served_by(candidate_ids, aborted + PROPAGATION) == 0

    def candidate_stopped():
        reconcile_deployment(deployment.pk)  # the passes that SIGTERM the drained candidate and see it exit
        return not Replica.objects.filter(pk__in=candidate_ids).exclude(state="stopped").exists()

    wait_until(candidate_stopped, "the candidate replicas to stop", 90, 0.2)
    deployment.refresh_from_db()
    assert deployment.engine_args == {} and routing.read_table()["chat"]["versions"][0]["track"] == "stable"
    # The candidate may have completed nothing before the abort: its failures are retried on
    # stable, and their usage events name the stable replica. The timeline says so then.
    on_candidate = ("no request completed on the candidate" if last_on_candidate is None else
                    f"last request started on the candidate "
                    f"{(last_on_candidate - aborted).total_seconds():+.1f}s from the abort")
    print(f"timeline bad candidate ({fault}): traffic at 50% then detected and aborted "
          f"{(aborted - weighted).total_seconds():.1f}s later; {on_candidate}; {load.ok} requests, "
          f"{len(load.failures)} failed")


def test_new_version_faulted_after_success_is_rolled_back_by_the_platform_with_no_failed_request(platform):
    client, deployment = platform["client"], platform["deployment"]
    slo_create(actor=platform["actor"], name="chat-ttft", scope="deployment", deployment=deployment,
               sli_kind="goodput", ttft_ms=250, objective=0.95, window="1d", budgeting="occurrences")
    with Load(client) as load, ControlLoop(deployment) as loop:
        rollout = rollouts.rollout_create(
            deployment=deployment, actor=platform["actor"], version=2, watch="3m",
            steps=[{"set_weight": 50}, {"analysis": {"duration": "10s", "min_requests": 8}}])
        wait_rollout(rollout, {"succeeded", "aborted"}, 180)
        assert rollout.status == "succeeded" and rollout.watching, rollout.message
        for replica in Replica.objects.filter(deployment=deployment, version__number=2, state="ready"):
            httpx.post(f"{replica.url}/admin/faults", json={"fault_ttft_ms": 400},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).raise_for_status()
        faulted = time.monotonic()
        wait_rollout(rollout, {"rolled_back"}, 120)
        detected_after = time.monotonic() - faulted
        rollback = rollout.rolled_back_by
        wait_rollout(rollback, {"succeeded", "aborted"}, 120)
        load_goes_on(timezone.now())  # on v1 after the rollback
    assert rollback.status == "succeeded", rollback.message
    assert load.failures == [], load.failures[:3]
    assert loop.errors == []
    assert "chat-ttft burn rate" in rollout.message and rollout.timeline[-1]["event"] == "rolled back"
    look = rollout.measurements.get(verdict="fail")
    alert = Alert.objects.get(labels__alertname="RolloutRolledBack", labels__rollout=str(rollout.pk))
    assert alert.status == "firing" and alert.annotations["rollout_url"].endswith(f"/rollouts/{rollout.pk}/")
    deployment.refresh_from_db()
    assert deployment.version.number == 1 and deployment.model.aliases.get(name="champion").version.number == 1
    ingest_usage(budget_s=5)
    back = event_time(rollback, "succeeded")
    new_ids = list(Replica.objects.filter(deployment=deployment, version__number=2).values_list("pk", flat=True))
    assert served_by(new_ids, back + PROPAGATION) == 0
    print(f"timeline watch: v2 succeeded, then 400 ms of TTFT injected into it; the platform rolled it back "
          f"{detected_after:.1f}s later (new version {look.candidate['requests']} requests, burn "
          f"{look.checks[0]['candidate']}; previous {look.stable['requests']} requests, burn "
          f"{look.checks[0]['stable']}); v1 took all traffic back "
          f"{(back - event_time(rollout, 'rolled back')).total_seconds():.1f}s after that; "
          f"{load.ok} requests, {len(load.failures)} failed")


def test_blue_green_preview_promotion_and_instant_rollback(platform):
    client, deployment = platform["client"], platform["deployment"]
    with Load(client) as load, ControlLoop(deployment) as loop:
        rollout = rollouts.rollout_create(deployment=deployment, actor=platform["actor"], version=2,
                                          strategy="blue-green", preview={}, scale_down_delay="5m")
        wait_until(lambda: "chat--preview" in routing.read_table(), "the preview route", 120, 0.2)
        # Smoke test through the preview route: only the candidate answers it, with the same key.
        preview = wait_until(lambda: client.chat.completions.create(
            model="chat--preview", max_tokens=2, messages=[{"role": "user", "content": "smoke"}],
            extra_body={"ignore_eos": True}), "preview", 15, 0.2, ignore=(openai.APIError,))
        assert preview.usage.completion_tokens == 2
        rollout.refresh_from_db()
        assert rollout.status == "paused" and rollout.weight == 0
        # At weight 0 nothing but the preview reaches the candidate: the answer came from it.
        wait_until(lambda: served_by(rollout.replicas.values_list("pk", flat=True), rollout.created_at),
                   "the preview request in the usage ledger, served by the candidate", 15, 0.2)
        rollouts.rollout_promote(rollout=rollout, actor=platform["actor"])
        wait_rollout(rollout, {"succeeded"}, 60)
        switched = event_time(rollout, "succeeded")
        old_ids = list(Replica.objects.filter(deployment=deployment, version__number=1).values_list("pk", flat=True))
        new_ids = list(rollout.replicas.values_list("pk", flat=True))
        wait_until(lambda: served_by(new_ids, switched), "requests served by v2 after the switch", 30, 0.2)
        assert Replica.objects.filter(pk__in=old_ids, state="ready").count() == 1  # kept warm

        undo_at = time.monotonic()
        rollback = rollouts.rollout_undo(deployment=deployment, actor=platform["actor"])
        wait_rollout(rollback, {"succeeded"}, 30)
        back_after = time.monotonic() - undo_at
        load_goes_on(event_time(rollback, "succeeded"))
    assert load.failures == [] and loop.errors == []
    deployment.refresh_from_db()
    assert deployment.version.number == 1
    ingest_usage(budget_s=5)
    back = event_time(rollback, "succeeded")
    # Requests routed before the gateways saw the new table may still start for a moment.
    assert served_by(old_ids, back) > 0 and served_by(new_ids, back + PROPAGATION) == 0
    print(f"timeline blue-green: preview smoke test answered, promoted; undo put v1 back on all traffic "
          f"{back_after:.1f}s after the call (old set kept warm); {load.ok} requests, {len(load.failures)} failed")


def test_rollout_refused_while_the_budget_is_exhausted(platform):
    deployment, client = platform["deployment"], platform["client"]
    slo = slo_create(actor=platform["actor"], name="chat-availability", scope="deployment", deployment=deployment,
                     sli_kind="availability", objective=0.999, window="1d", budgeting="occurrences", min_requests=1)
    replica = Replica.objects.get(deployment=deployment, state="ready")
    httpx.post(f"{replica.url}/admin/faults", json={"fault_error_rate": 1.0},
               headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).raise_for_status()
    for _ in range(5):  # the only replica fails: these reach the client as errors and burn the budget
        with contextlib.suppress(openai.APIError):
            client.chat.completions.create(model="chat", max_tokens=2, messages=[{"role": "user", "content": "x"}])

    def exhausted():
        ingest_usage(budget_s=5)
        evaluate_slos()
        return SloStatus.objects.get(slo=slo).budget_remaining <= 0

    wait_until(exhausted, "the budget to be exhausted", 30, 0.2)
    with pytest.raises(Conflict, match="chat-availability"):
        rollouts.rollout_create(deployment=deployment, actor=platform["actor"], version=2)
    assert rollouts.rollout_create(deployment=deployment, actor=platform["actor"], version=2, rollback=True).rollback


def test_worker_killed_mid_rollout_then_recovered(platform, worker_env):
    deployment, tmp = platform["deployment"], platform["tmp"]
    # The real worker (with beat) runs the passes now; the test process only creates the rollout.
    env = {**worker_env, "REDIS_URL": platform["redis"].url, "INFEROPS_USAGE_INGEST_INTERVAL_S": "1"}
    worker = start_worker(env, tmp, "first")
    try:
        with Load(platform["client"]) as load:
            rollout = rollouts.rollout_create(
                deployment=deployment, actor=platform["actor"], version=2,
                steps=[{"set_weight": 50}, {"analysis": {"duration": "20s", "min_requests": 5}}])
            wait_until(lambda: Rollout.objects.get(pk=rollout.pk).weight == 50, "50% on the candidate", 120, 0.2)
            os.killpg(worker.pid, signal.SIGKILL)
            killed = time.monotonic()
            worker.wait(10)
            # What is under test is that nothing happens: three of the dead worker's 1 s reconcile
            # intervals pass, and the rollout stays where the worker left it.
            time.sleep(3)
            rollout.refresh_from_db()
            assert rollout.status == "progressing" and rollout.weight == 50  # nothing moved without a worker
            worker = start_worker(env, tmp, "second")
            wait_rollout(rollout, {"succeeded", "aborted"}, 180)
            recovered = time.monotonic() - killed
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
    assert rollout.status == "succeeded", rollout.message
    assert load.failures == [], load.failures[:3]
    # Exactly one candidate replica was ever started: the second worker adopted the state.
    assert rollout.replicas.count() == 1
    deployment.refresh_from_db()
    assert deployment.version.number == 2
    print(f"timeline worker killed at 50%: the second worker finished the rollout {recovered:.0f}s after the "
          f"kill; {load.ok} requests, {len(load.failures)} failed")
