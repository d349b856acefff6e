"""The installation's identity, and what happens when two installations share a Redis database."""

from __future__ import annotations

import logging
import uuid

import pytest

from inferops import health
from inferops.models import Installation, installation_id
from inferops.redis_client import redis_client
from inferops.tasks import heartbeat

pytestmark = pytest.mark.django_db


def test_the_identity_is_made_once_and_kept():
    assert not Installation.objects.exists()
    first = installation_id()
    assert uuid.UUID(first) and installation_id() == first
    assert Installation.objects.count() == 1


@pytest.fixture
def installation_key():
    client = redis_client()
    client.delete(health.INSTALLATION_KEY)
    yield client
    client.delete(health.INSTALLATION_KEY)


def test_a_redis_database_shared_with_another_installation_is_reported(client, installation_key, caplog):
    heartbeat()  # claims the Redis database for this installation
    assert installation_key.get(health.INSTALLATION_KEY).decode() == installation_id()
    assert 0 < installation_key.ttl(health.INSTALLATION_KEY) <= health.INSTALLATION_CLAIM_S
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json()["redis"] == "ok"

    installation_key.set(health.INSTALLATION_KEY, "other-installation")
    with caplog.at_level(logging.ERROR, logger="inferops.tasks"):
        heartbeat()
    assert "also used by inferops installation other-installation" in caplog.text
    assert installation_key.get(health.INSTALLATION_KEY) == b"other-installation"  # never taken over
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["redis"] == "shared"
    assert "its own (REDIS_URL=redis://host:6379/<n>)" in response.json()["redis_problem"]

    installation_key.delete(health.INSTALLATION_KEY)  # the other one's claim expired
    heartbeat()
    assert client.get("/healthz").json()["redis"] == "ok"
