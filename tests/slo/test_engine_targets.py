"""Latency targets from SLOs to the engines (slo/engine_targets.py): the tightest thresholds, pushed
to a real running replica of the tiny checkpoint when an SLO changes (no restart), and the tenants'
published for the gateways in Redis."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from deployments.choices import Backend, ReplicaState
from deployments.models import Replica
from deployments.replicas.drivers.base import ReplicaSpec
from deployments.replicas.drivers.kubernetes import KubernetesSettings, ManifestRenderer
from deployments.replicas.drivers.local import replica_env
from inferops.redis_client import redis_client
from inferops.replica_admin import replica_admin_token
from runtime.gateway.contract import SLO_TARGETS_GENERATION_KEY, SLO_TARGETS_KEY, slo_targets_field
from slo.engine_targets import deployment_targets, sync_engine_targets, targets_for
from slo.models import Slo
from slo.services import slo_create, slo_delete, slo_update
from tests.conftest import free_port
from tests.evals.replica import Replica as ServeProcess
from tests.slo.conftest import make_deployment

TOKEN = "engine-targets-test"


def slo(**fields) -> Slo:
    return Slo(name="x", objective=0.99, **fields)


def test_targets_are_the_tightest_thresholds_of_latency_and_goodput_slos():
    assert targets_for([]) == {"ttft_ms": None, "tpot_ms": None}
    assert targets_for([slo(sli_kind="latency", ttft_ms=2000), slo(sli_kind="goodput", ttft_ms=1500, tpot_ms=120),
                        slo(sli_kind="latency", tpot_ms=90, e2e_ms=9000),
                        slo(sli_kind="availability")]) == {"ttft_ms": 1500.0, "tpot_ms": 90.0}
    assert targets_for([slo(sli_kind="latency", e2e_ms=5000)]) == {"ttft_ms": None, "tpot_ms": None}


@pytest.mark.django_db
def test_a_deployment_takes_its_own_and_its_models_slos_not_a_tenants():
    chat = make_deployment("chat")
    make_deployment("other")
    slo_create(actor=None, name="chat-ttft", deployment=chat, sli_kind="latency", ttft_ms=1800, objective=0.99)
    slo_create(actor=None, name="model-tpot", scope="model", model=chat.model, sli_kind="latency", tpot_ms=150,
               objective=0.99)
    slo_create(actor=None, name="acme-ttft", scope="tenant", tenant="acme", deployment=chat, sli_kind="latency",
               ttft_ms=500, objective=0.99)
    assert deployment_targets(chat) == {"ttft_ms": 1800.0, "tpot_ms": 150.0}


@pytest.fixture
def serving(tiny_llama_dir, tmp_path, monkeypatch):
    """A real `inferops serve` with the admin token the control plane sends."""
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", TOKEN)
    process = ServeProcess(tiny_llama_dir, tmp_path / "serve.log").start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def replica_targets(url: str) -> dict:
    response = httpx.get(f"{url}/admin/slo-targets", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.django_db(transaction=True)
def test_an_slo_change_reaches_a_running_replica_without_a_restart(serving):
    chat = make_deployment("chat")
    Replica.objects.create(deployment=chat, version=chat.version, node="test", url=serving.base_url,
                           state=ReplicaState.READY)
    # A replica that does not answer is skipped (and retried next tick), the others still get theirs.
    Replica.objects.create(deployment=chat, version=chat.version, node="test",
                           url=f"http://127.0.0.1:{free_port()}", state=ReplicaState.READY)
    pid = serving.process.pid
    assert replica_targets(serving.base_url)["source"] == "engine"

    latency = slo_create(actor=None, name="chat-latency", deployment=chat, sli_kind="latency", ttft_ms=1200,
                         tpot_ms=80, objective=0.99)
    assert sync_engine_targets() == {"tenant_entries": 0, "pushed": 1, "failed": 1}
    assert replica_targets(serving.base_url) == {"ttft_ms": 1200.0, "tpot_ms": 80.0, "source": "control-plane"}

    slo_update(slo=latency, actor=None, ttft_ms=700)
    sync_engine_targets()
    assert replica_targets(serving.base_url)["ttft_ms"] == 700.0

    slo_delete(slo=latency, actor=None)
    sync_engine_targets()
    assert replica_targets(serving.base_url) == {"ttft_ms": 2000.0, "tpot_ms": 200.0, "source": "engine"}
    assert serving.process.pid == pid and serving.process.poll() is None


@pytest.mark.django_db
def test_an_slo_write_queues_a_sync_after_its_commit(django_capture_on_commit_callbacks, monkeypatch):
    queued = []
    monkeypatch.setattr("inferops.celery.enqueue", lambda name, *args, **kw: queued.append(name))
    chat = make_deployment("chat")
    with django_capture_on_commit_callbacks(execute=True):
        latency = slo_create(actor=None, name="chat-latency", deployment=chat, sli_kind="latency", ttft_ms=900,
                             objective=0.99)
    with django_capture_on_commit_callbacks(execute=True):
        slo_delete(slo=latency, actor=None)
    assert queued.count("slo.sync_engine_targets") == 2


@pytest.mark.django_db
def test_tenant_targets_are_published_for_the_gateways():
    chat = make_deployment("chat")
    redis = redis_client()
    generation = int(redis.get(SLO_TARGETS_GENERATION_KEY) or 0)
    acme = slo_create(actor=None, name="acme-ttft", scope="tenant", tenant="acme", deployment=chat,
                      sli_kind="goodput", ttft_ms=500, tpot_ms=60, objective=0.99)
    slo_create(actor=None, name="acme-e2e", scope="tenant", tenant="acme", deployment=chat, sli_kind="latency",
               ttft_ms=400, objective=0.99)
    slo_create(actor=None, name="globex-e2e", scope="tenant", tenant="globex", deployment=chat, sli_kind="latency",
               e2e_ms=9000, objective=0.99)  # no TTFT or TPOT: nothing for the engine
    assert sync_engine_targets()["tenant_entries"] == 1
    table = {k.decode(): json.loads(v) for k, v in redis.hgetall(SLO_TARGETS_KEY).items()}
    assert table == {slo_targets_field("chat", "acme"): {"ttft_ms": 400.0, "tpot_ms": 60.0}}
    assert int(redis.get(SLO_TARGETS_GENERATION_KEY)) > generation
    slo_delete(slo=acme, actor=None)
    Slo.objects.filter(tenant="acme").delete()
    sync_engine_targets()
    assert redis.hgetall(SLO_TARGETS_KEY) == {}


def test_built_in_replicas_get_the_admin_token_in_their_environment_and_vllm_ones_do_not(monkeypatch, settings):
    monkeypatch.delenv("INFEROPS_ADMIN_TOKEN", raising=False)
    derived = replica_admin_token()
    assert len(derived) == 64 and derived != settings.SECRET_KEY
    settings.SECRET_KEY = "another-installation"
    assert replica_admin_token() != derived  # derived from the installation's secret
    spec = ReplicaSpec(deployment="chat", version=1, model_path="/m", backend=Backend.BUILTIN)
    assert replica_env(spec, "marker")["INFEROPS_ADMIN_TOKEN"] == replica_admin_token()
    assert "INFEROPS_ADMIN_TOKEN" not in replica_env(ReplicaSpec(deployment="chat", version=1, model_path="/m",
                                                                 backend=Backend.VLLM), "marker")
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", "operators-own")
    assert replica_admin_token() == "operators-own"


def test_kubernetes_built_in_replicas_read_the_token_from_a_secret_never_from_their_deployment(monkeypatch):
    monkeypatch.delenv("INFEROPS_ADMIN_TOKEN", raising=False)
    renderer = ManifestRenderer(KubernetesSettings())
    installation = "0b6e2b0c-4f5e-4d8a-9a43-3c1f6c1b2d7e"

    def deployment(backend):
        spec = ReplicaSpec(deployment="chat", version=1, model_path="/models/m", backend=backend)
        return renderer.deployment(spec, 1, installation=installation)

    def container(backend):
        [only] = deployment(backend)["spec"]["template"]["spec"]["containers"]
        return only

    secret = renderer.admin_secret(installation)
    assert secret["kind"] == "Secret" and secret["stringData"] == {"token": replica_admin_token()}
    assert secret["metadata"]["name"] == f"inferops-replica-admin-{installation}"
    assert container(Backend.BUILTIN)["env"] == [{"name": "INFEROPS_ADMIN_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}}}]
    # Whoever may read Deployments (or `ps` in the pod) does not learn the token.
    assert replica_admin_token() not in json.dumps(deployment(Backend.BUILTIN))
    assert "INFEROPS_ADMIN_TOKEN" not in json.dumps(container(Backend.VLLM))
    # A new token changes the pod template, so the pods restart and read it.
    before = deployment(Backend.BUILTIN)["spec"]["template"]["metadata"]["annotations"]
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", "rotated")
    after = deployment(Backend.BUILTIN)["spec"]["template"]["metadata"]["annotations"]
    assert before != after and "rotated" not in json.dumps(after)
    # Keyed with SECRET_KEY: a short token cannot be guessed from the digest offline.
    assert hashlib.sha256(b"rotated").hexdigest() not in json.dumps(after)
