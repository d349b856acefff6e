"""The reconcile loop against real replica processes (`inferops serve` on the tiny checkpoint).

Passes are driven by calling reconcile_deployment() in the test, so each step is observable;
the Celery task is a thin wrapper around the same function.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from deployments.replicas import routing
from deployments.replicas.drivers.local import LocalProcessDriver, find_replica_process, process_start_time
from deployments.replicas.reconcile import Reconciler, backoff_s, reconcile_deployment
from registry import services as registry_services
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"routing_propagation_s": 0.5, "backoff_base_s": 0.2, "health_timeout_s": 1, "drain_timeout_s": 20}


@pytest.fixture(autouse=True)
def fast_timings(settings, tmp_path):
    settings.INFEROPS_RECONCILE_TIMINGS = FAST
    settings.INFEROPS_DATA_DIR = tmp_path


@pytest.fixture
def operator(make_user):
    return make_user("operator")


@pytest.fixture
def tiny_model(operator, tiny_llama_dir):
    model = registry_services.model_create(name="tiny", task="generate", actor=operator)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=operator)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=operator)
    return model


def live_replicas(deployment):
    return list(Replica.objects.filter(deployment=deployment).exclude(state=ReplicaState.STOPPED))


def reconcile_until(deployment, predicate, timeout=90.0, interval=0.3) -> float:
    """Reconcile passes until `predicate(deployment)` holds; returns when it did (time.monotonic())."""

    def converged():
        reconcile_deployment(deployment.pk)
        deployment.refresh_from_db()
        return predicate(deployment) and time.monotonic()

    def states():
        replicas = [(r.pk, r.version.number, r.state, r.last_error) for r in deployment.replica_set.all()]
        return f"convergence: {deployment.status} {replicas}"

    return wait_until(converged, states, timeout, interval)


def all_ready(count, version=None):
    def check(deployment):
        live = live_replicas(deployment)
        wanted = version or deployment.version.number
        return (len(live) == count and all(r.state == ReplicaState.READY for r in live)
                and all(r.version.number == wanted for r in live))
    return check


@pytest.fixture
def cleanup():
    deployments = []
    yield deployments.append
    driver = LocalProcessDriver()
    for deployment in deployments:
        for replica in Replica.objects.filter(deployment=deployment):
            driver.kill(replica)


def server_pid(supervisor: int) -> int:
    with open(f"/proc/{supervisor}/task/{supervisor}/children") as handle:
        return int(handle.read().split()[0])


def complete(url: str, model: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4},
                          timeout=30)
    response.raise_for_status()
    return response.json()["choices"][0]["finish_reason"]


def test_deploy_two_replicas_then_sigkill_one_is_replaced_quickly(tiny_model, operator, cleanup):
    deployment = deployment_services.deployment_create(name="chat", model=tiny_model, version=1,
                                                       replicas=2, actor=operator)
    cleanup(deployment)
    reconcile_until(deployment, all_ready(2))
    assert deployment.status == "ready"
    table = routing.read_table()["chat"]
    urls = sorted(r["url"] for r in table["versions"][0]["replicas"])
    assert len(urls) == 2 and table["versions"][0]["weight"] == 100
    for url in urls:
        assert complete(url, "chat") in ("stop", "length")

    victim = live_replicas(deployment)[0]
    os.kill(server_pid(victim.identity["pid"]), signal.SIGKILL)  # the model server, as the OOM killer would
    killed_at = time.monotonic()
    os.waitpid(victim.identity["pid"], 0)  # its supervisor has recorded the exit and is gone
    ready_at = reconcile_until(deployment, all_ready(2), timeout=30)
    print(f"SIGKILLed replica routable again after {ready_at - killed_at:.1f}s")
    assert ready_at - killed_at < 15
    victim.refresh_from_db()
    assert victim.restarts == 1 and victim.state == ReplicaState.READY
    # How it died stays on the row after the restart.
    assert victim.last_error.startswith("process exited: killed by signal 9 (SIGKILL), not sent by this installation")
    assert len(routing.read_table()["chat"]["versions"][0]["replicas"]) == 2


def test_version_change_replaces_one_at_a_time_without_failed_requests(tiny_model, operator, cleanup):
    deployment = deployment_services.deployment_create(name="rolling", model=tiny_model, version=1,
                                                       replicas=2, actor=operator)
    cleanup(deployment)
    reconcile_until(deployment, all_ready(2))

    results = {"ok": 0, "failed": []}
    stop = threading.Event()

    def load_loop():
        # Routes like the gateway will: from the published table, retrying another replica on a
        # connection error or a 503 before the first byte.
        while not stop.is_set():
            replicas = [r for v in routing.read_table()["rolling"]["versions"] for r in v["replicas"]]
            random.shuffle(replicas)
            for attempt, replica in enumerate(replicas):
                try:
                    response = httpx.post(f"{replica['url']}/v1/completions", timeout=30,
                                          json={"model": "rolling", "prompt": "Hi", "max_tokens": 3})
                except httpx.TransportError:
                    continue
                if response.status_code == 503 and attempt + 1 < len(replicas):
                    continue
                if response.status_code == 200:
                    results["ok"] += 1
                else:
                    results["failed"].append(response.status_code)
                break
            else:
                results["failed"].append("no replica answered")

    thread = threading.Thread(target=load_loop, daemon=True)
    thread.start()
    try:
        deployment_services.deployment_update(deployment=deployment, actor=operator, version=2)
        max_live = 0

        def converged(d):
            nonlocal max_live
            max_live = max(max_live, len([r for r in live_replicas(d) if r.state != ReplicaState.DRAINING]))
            return all_ready(2, version=2)(d) and not Replica.objects.filter(
                deployment=d, state=ReplicaState.DRAINING).exists()

        reconcile_until(deployment, converged, timeout=120)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert results["failed"] == [] and results["ok"] > 5, results
    assert max_live <= 3  # surge one: never more than desired + 1
    assert {r["version"] for r in routing.read_table()["rolling"]["versions"]} == {2}
    assert Replica.objects.filter(deployment=deployment, version__number=1, state=ReplicaState.STOPPED).count() == 2


class CrashAfterStart(LocalProcessDriver):
    """A worker that dies right after starting a process, before the pid reaches the database."""

    def start(self, replica, spec):
        super().start(replica, spec)
        raise KeyboardInterrupt("worker killed")


def test_worker_killed_mid_reconcile_converges_without_duplicates(tiny_model, operator, cleanup):
    deployment = deployment_services.deployment_create(name="adopt", model=tiny_model, version=1,
                                                       replicas=1, actor=operator)
    cleanup(deployment)
    deployment = Deployment.objects.select_related("version", "model").get(pk=deployment.pk)
    with pytest.raises(KeyboardInterrupt):
        Reconciler(deployment, driver=CrashAfterStart()).run()
    replica = Replica.objects.get(deployment=deployment)
    assert replica.state == ReplicaState.STARTING and replica.identity == {}
    orphan = find_replica_process(LocalProcessDriver().marker(replica))
    assert orphan is not None

    reconcile_until(deployment, all_ready(1))
    replica.refresh_from_db()
    assert replica.identity["pid"] == orphan  # adopted, not started twice
    assert Replica.objects.filter(deployment=deployment).count() == 1
    assert replica.restarts == 0


def test_scale_down_then_delete_drains_everything(tiny_model, operator, cleanup):
    deployment = deployment_services.deployment_create(name="shrink", model=tiny_model, version=1,
                                                       replicas=2, actor=operator)
    cleanup(deployment)
    reconcile_until(deployment, all_ready(2))
    deployment_services.deployment_update(deployment=deployment, actor=operator, replicas=1)
    reconcile_until(deployment, lambda d: all_ready(1)(d) and not Replica.objects.filter(
        deployment=d, state=ReplicaState.DRAINING).exists())
    pids = [r.identity["pid"] for r in Replica.objects.filter(deployment=deployment)]

    deployment_services.deployment_delete(deployment=deployment, actor=operator)
    wait_until(lambda: reconcile_deployment(deployment.pk) == "deleted", "the deployment to be deleted", 60, 0.3)
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert "shrink" not in routing.read_table()

    def running():
        for pid in pids:
            LocalProcessDriver()._reap(type("R", (), {"identity": {"pid": pid}})())
        return [pid for pid in pids if process_start_time(pid) is not None]  # None: gone, or a zombie
    wait_until(lambda: running() == [], lambda: f"every replica process to exit (running: {running()})", 10, 0.1)


def test_broken_checkpoint_crash_loops_with_backoff(tiny_model, operator, cleanup, tmp_path, tiny_llama_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    version = registry_services.version_register(model=tiny_model, artifact_uri=str(broken), actor=operator)
    (broken / "model.safetensors").write_bytes(b"garbage")  # the replica will die while loading
    deployment = deployment_services.deployment_create(name="crashy", model=tiny_model,
                                                       version=version.number, replicas=1, actor=operator)
    cleanup(deployment)
    reconcile_until(deployment, lambda d: d.status == "failed", timeout=90)
    replica = live_replicas(deployment)[0]
    assert replica.crash_looping and replica.consecutive_failures >= 3 and replica.restarts >= 2
    assert "process exited while starting: exited with code 1" in replica.last_error
    assert "crash-looping" in deployment.status_message


def test_backoff_grows_and_caps():
    from deployments.replicas.reconcile import Timings

    timings = Timings(backoff_base_s=2, backoff_max_s=60)
    assert [backoff_s(n, timings) for n in range(1, 8)] == [0, 2, 4, 8, 16, 32, 60]
