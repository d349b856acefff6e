"""Scale to zero and back, end to end: a parked deployment serves its first requests after a cold start,
the held requests answered and the cold start recorded, then parks again after idling.

Real parts: a replica process the worker starts, a gateway process, a private Redis, Postgres, and a
Celery worker with beat that autoscales (every second), wakes parked deployments (every half second),
reconciles and scrapes.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from capacity.models import ScalingDecision
from capacity.policy import AutoscalingPolicySerializer
from capacity.scaling import policy_save
from deployments import services as deployment_services
from deployments.choices import DeploymentStatus
from deployments.models import Deployment, Replica, ReplicaStart
from deployments.replicas import routing
from registry import services as registry_services
from tenants import services as tenant_services
from tenants.publish import publish_keys
from tests.e2e.conftest import private_redis, start_gateway, stop_stack  # noqa: F401
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]
PARK_AFTER_S = 30  # the shortest a policy allows


def parked(deployment: Deployment) -> bool:
    deployment.refresh_from_db()
    entry = routing.read_table().get(deployment.name) or {}
    return (deployment.replicas == 0 and deployment.status == DeploymentStatus.PARKED
            and not Replica.objects.filter(deployment=deployment, state__in=["ready", "starting", "draining"]).exists()
            and not any(version["replicas"] for version in entry.get("versions", [])))


def test_a_parked_deployment_wakes_for_held_requests_and_parks_again(private_redis, worker_env, tmp_path,  # noqa: F811
                                                                     make_user, tiny_llama_dir):
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    chat = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor)
    policy = AutoscalingPolicySerializer(data={"enabled": True, "min_replicas": 0, "max_replicas": 1, "cooldown_s": 0,
                                    "park_after_s": PARK_AFTER_S, "hold": {"max_wait_s": 120, "max_queue": 10}},
                              context={"deployment": chat})
    assert policy.is_valid(), policy.errors
    policy_save(deployment=chat, actor=actor, data=policy.validated_data)
    tenant = tenant_services.tenant_create(name="acme", actor=actor)
    _, key = tenant_services.key_create(tenant=tenant, name="app", actor=actor)
    publish_keys()
    env = {**worker_env, "REDIS_URL": private_redis.url, "INFEROPS_AUTOSCALE_INTERVAL_S": "1",
           "INFEROPS_WAKE_POLL_S": "0.5"}
    worker = start_worker(env, tmp_path, "worker")
    gateway = None
    try:
        gateway, base = start_gateway(private_redis.url, tmp_path / "spool")
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        wait_until(lambda: httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers,
                                      timeout=30).status_code == 200, "chat to serve", 120, 0.5)

        wait_until(lambda: parked(chat), "chat to park after idling", PARK_AFTER_S + 60, 1)
        assert ScalingDecision.objects.filter(deployment=chat, kind="park").count() == 1

        # Parked: a streamed and a plain request arrive together; the gateway holds both.
        answers: dict[str, tuple[int, str, float]] = {}

        def ask(stream: bool) -> None:
            began = time.monotonic()
            with httpx.Client(timeout=120) as client, client.stream(
                    "POST", f"{base}/v1/chat/completions", json={**body, "stream": stream}, headers=headers) as r:
                answers["stream" if stream else "plain"] = (r.status_code, r.read().decode(), time.monotonic() - began)

        threads = [threading.Thread(target=ask, args=(stream,)) for stream in (True, False)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
        assert answers["stream"][0] == 200 and answers["stream"][1].rstrip().endswith("data: [DONE]"), answers
        assert answers["plain"][0] == 200 and '"choices"' in answers["plain"][1], answers
        wake = ScalingDecision.objects.get(deployment=chat, kind="wake")
        assert (wake.from_replicas, wake.to_replicas) == (0, 1) and "held" in wake.reason

        # The cold start, phase by phase, on the API.
        start = ReplicaStart.objects.filter(deployment=chat).order_by("-started_at").first()
        assert start.cause == "from_zero"
        wait_until(lambda: ReplicaStart.objects.get(pk=start.pk).first_token_at is not None,
                   "the first token of the woken replica to be recorded", 60, 0.5)
        start.refresh_from_db()
        seconds = start.seconds()
        assert 0 <= seconds["process"] <= seconds["weights_loaded"] <= seconds["ready"] <= seconds["first_token"]
        # What the held requests waited is about the cold start (plus routing and the answer itself).
        assert min(answer[2] for answer in answers.values()) >= seconds["ready"] * 0.5

        wait_until(lambda: parked(chat), "chat to park again", PARK_AFTER_S + 60, 1)
        kinds = list(ScalingDecision.objects.filter(deployment=chat).order_by("at").values_list("kind", flat=True))
        assert kinds == ["park", "wake", "park"], kinds
    finally:
        stop_stack(worker, gateway)
