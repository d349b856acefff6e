"""Fixtures shared by the deployment and rollout tests."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, Rollout
from deployments.replicas import reconcile, routing
from deployments.replicas.drivers.base import Started
from deployments.rollouts import services as rollouts
from registry import services as registry_services
from registry.models import ModelVersion, RegisteredModel
from tenants.models import UsageEvent


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def make_version(model: RegisteredModel, number: int) -> ModelVersion:
    """A version row without a checkpoint: neither the API nor the console opens it."""
    return ModelVersion.objects.create(
        model=model, number=number, artifact_uri="/nowhere", digest=f"{number}" * 64,
        architecture="LlamaForCausalLM", parameter_count=1, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=320, max_context=256, dtype="float32", weight_bytes=4,
        kv_cache_bytes_per_token=512, has_tokenizer=True, has_chat_template=True,
    )


# ---------------------------------------------------------------------------------------------
# Rollouts pass by pass: `world`, a deployment on an in-memory driver and a clock the test moves


class MemoryDriver:
    """Processes that exist while not stopped; `crashing` versions die as soon as they start."""

    node = "test-node"

    def __init__(self):
        self.dead: set[int] = set()
        self.crashing: set[int] = set()  # version ids
        self.started: list[int] = []

    def start(self, replica, spec):
        self.started.append(replica.pk)
        if replica.version_id in self.crashing:
            self.dead.add(replica.pk)
        else:
            self.dead.discard(replica.pk)
        return Started(url=f"http://replica-{replica.pk}.test", port=None, identity={"pid": replica.pk})

    def is_alive(self, replica):
        return replica.pk not in self.dead

    def stop(self, replica, grace_s, why=""):
        self.dead.add(replica.pk)

    def kill(self, replica, why=""):
        self.dead.add(replica.pk)

    def exit_status(self, replica):
        return "exited with code 1"

    def log_tail(self, replica, lines=20):
        return ""


@pytest.fixture
def world(settings, monkeypatch, make_user, tiny_llama_dir, tmp_path):
    """A deployment `chat` of v1 with two ready replicas; v2 registered; a clock the test moves."""
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0, "backoff_base_s": 0, "crash_loop_after": 2}
    settings.INFEROPS_DATA_DIR = tmp_path
    monkeypatch.setattr(reconcile, "probe_health", lambda url, timeout: True)
    monkeypatch.setattr(deployment_services, "request_reconcile", lambda deployment: None)
    monkeypatch.setattr(rollouts, "request_reconcile", lambda deployment: None)
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    for _ in range(2):
        registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, replicas=2, actor=actor)

    class World:
        driver = MemoryDriver()
        now = timezone.now()
        user = actor

        def tick(self, seconds: float = 2) -> Deployment:
            """One reconcile pass `seconds` after the previous one."""
            self.now += timedelta(seconds=seconds)
            fresh = Deployment.objects.select_related("version", "model").get(pk=deployment.pk)
            reconcile.Reconciler(fresh, now=self.now, driver=self.driver).run()
            return fresh

        def rollout(self) -> Rollout:
            return Rollout.objects.filter(deployment=deployment).order_by("-id").first()

        def live(self, version: int | None = None) -> list[Replica]:
            rows = Replica.objects.filter(deployment=deployment).exclude(
                state__in=[ReplicaState.STOPPED, ReplicaState.DRAINING]).select_related("version")
            return [r for r in rows if version is None or r.version.number == version]

        def weights(self, name: str = "chat") -> dict[str, int]:
            entry = routing.read_table().get(name)
            return {v["track"]: v["weight"] for v in entry["versions"]} if entry else {}

        def events(self, replicas, count: int, *, status=200, ttft_ms=50.0, failed_replica=None, at=None):
            at = at or self.now
            for index in range(count):
                replica = replicas[index % len(replicas)]
                UsageEvent.objects.create(
                    request_id=uuid.uuid4().hex, time=at, deployment="chat", version=replica.version.number,
                    replica=replica.pk, failed_replica=failed_replica, endpoint="chat", stream=True,
                    prompt_tokens=10, completion_tokens=8, ttft_ms=ttft_ms, tpot_ms=10.0, e2e_ms=150.0,
                    status=status, error_kind="upstream_error" if status >= 500 else None)

    w = World()
    w.deployment = deployment
    w.tick()
    w.tick()
    assert [r.state for r in w.live(1)] == [ReplicaState.READY] * 2
    return w


def start(world, **kwargs) -> Rollout:
    return rollouts.rollout_create(deployment=world.deployment, actor=world.user, **kwargs)
