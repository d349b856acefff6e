"""GET /api/v1/prometheus/sd/: Prometheus' http_sd_config format, read with a viewer's token sent
as Prometheus' `authorization` block sends it (Bearer)."""

from __future__ import annotations

import json
import time

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from deployments.choices import ReplicaState
from deployments.models import Replica
from inferops.redis_client import redis_client
from runtime.gateway.contract import GATEWAY_STALE_S, GATEWAYS_KEY
from tests.deployments.metrics_helpers import deployment_with_replicas
from tests.waiting import wait_until

URL = "/api/v1/prometheus/sd/"


@pytest.fixture(autouse=True)
def no_gateways():
    redis_client().delete(GATEWAYS_KEY)
    yield
    redis_client().delete(GATEWAYS_KEY)


def bearer(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=user).key}")
    return client


def test_a_viewer_token_as_bearer_reads_the_targets_and_nothing_else_does(make_user, tiny_llama_dir, api):
    deployment_with_replicas(tiny_llama_dir, replicas=1)
    assert bearer(make_user("viewer")).get(URL).status_code == 200
    assert api("viewer").get(URL).status_code == 200  # the usual `Token` scheme too
    anonymous = APIClient().get(URL)
    assert anonymous.status_code == 401 and "detail" in anonymous.json()
    assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = APIClient()
    wrong.credentials(HTTP_AUTHORIZATION="Bearer not-a-token")
    assert wrong.get(URL).status_code == 401
    assert bearer(make_user(None)).get(URL).status_code == 403  # a user without a role


def test_a_bare_token_as_http_sd_sends_it_without_a_type_is_accepted(make_user, db):
    """Prometheus' http_sd_config leaves out `Bearer` when `authorization.type` is not written
    (prometheus/prometheus#12762); tests/test_prometheus_real.py shows Debian's 2.42 doing it."""
    token = Token.objects.create(user=make_user("viewer")).key
    bare = APIClient()
    bare.credentials(HTTP_AUTHORIZATION=token)
    assert bare.get(URL).status_code == 200
    wrong = APIClient()
    wrong.credentials(HTTP_AUTHORIZATION="0" * 40)
    assert wrong.get(URL).status_code == 401


def test_every_ready_replica_with_the_labels_the_rules_select_on(make_user, tiny_llama_dir):
    deployment, versions, replicas = deployment_with_replicas(tiny_llama_dir, replicas=3, versions=2)
    replicas[0].url = "http://10.0.0.5:8101"
    replicas[0].save()
    Replica.objects.filter(pk=replicas[1].pk).update(state=ReplicaState.STARTING)
    groups = bearer(make_user("viewer")).get(URL).json()
    by_replica = {g["labels"]["replica"]: g for g in groups}
    assert set(by_replica) == {str(replicas[0].pk), str(replicas[2].pk)}  # only ready ones
    first = by_replica[str(replicas[0].pk)]
    assert first == {"targets": ["10.0.0.5:8101"], "labels": {
        "__metrics_path__": "/metrics", "__scheme__": "http", "component": "replica",
        "deployment": "chat", "version": "1", "replica": str(replicas[0].pk), "track": "stable",
        "backend": "builtin"}}
    # The third replica runs version 1 too (round-robin over 2 versions: 1, 2, 1).
    assert by_replica[str(replicas[2].pk)]["labels"]["track"] == "stable"


def test_a_replica_of_another_version_is_outdated(make_user, tiny_llama_dir):
    _, _, replicas = deployment_with_replicas(tiny_llama_dir, replicas=2, versions=2)
    groups = bearer(make_user("viewer")).get(URL).json()
    tracks = {g["labels"]["version"]: g["labels"]["track"] for g in groups}
    assert tracks == {"1": "stable", "2": "outdated"}


def test_gateways_with_a_recent_heartbeat_are_targets_without_a_deployment_label(make_user, db):
    now = time.time()
    redis_client().hset(GATEWAYS_KEY, mapping={
        "gw-a": json.dumps({"instance": "gw-a", "address": "10.0.0.9:8080", "metrics_path": "/metrics",
                            "seen_at": now}),
        "gw-dead": json.dumps({"instance": "gw-dead", "address": "10.0.0.10:8080", "metrics_path": "/metrics",
                               "seen_at": now - GATEWAY_STALE_S - 5}),
    })
    groups = bearer(make_user("viewer")).get(URL).json()
    assert groups == [{"targets": ["10.0.0.9:8080"], "labels": {
        "__metrics_path__": "/metrics", "component": "gateway", "gateway": "gw-a"}}]


def test_a_gateway_announces_itself_and_leaves_on_shutdown(tmp_path, db):
    import asyncio

    from django.conf import settings

    from runtime.gateway.server import Gateway, GatewaySettings

    gateway = Gateway(GatewaySettings(redis_url=settings.REDIS_URL, instance="gw-test",
                                      advertise_address="127.0.0.1:18080", spool_dir=tmp_path))

    async def run():
        await gateway.startup()
        # Polled from a thread: the announcement runs on this event loop.
        await asyncio.to_thread(wait_until, lambda: redis_client().hexists(GATEWAYS_KEY, "gw-test"),
                                "the gateway to announce itself", 5, 0.02)
        entry = json.loads(redis_client().hget(GATEWAYS_KEY, "gw-test"))
        await gateway.shutdown()
        return entry

    entry = asyncio.run(run())
    assert entry["address"] == "127.0.0.1:18080" and entry["metrics_path"] == "/metrics"
    assert not redis_client().hexists(GATEWAYS_KEY, "gw-test")
