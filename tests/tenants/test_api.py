"""Tenants and keys REST API: the contract, keys shown once and stored hashed, what is published
to Redis for the gateways, roles, and every bad input refused with nothing written."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from inferops.models import AuditEvent
from inferops.redis_client import redis_client
from runtime.gateway.contract import KEYS_CHANNEL, KEYS_GENERATION_KEY
from tenants import publish
from tenants.models import ApiKey, Tenant
from tenants.tasks import publish_keys_task

pytestmark = pytest.mark.django_db

KEY_FORMAT = re.compile(r"^iop_([0-9a-f]{8})_[A-Za-z0-9_-]{40}$")


@pytest.fixture
def acme(api):
    response = api("operator").post("/api/v1/tenants/", {"name": "acme", "display_name": "Acme Corp",
                                                         "rpm_limit": 600, "tpm_limit": 100000}, format="json")
    assert response.status_code == 201, response.content
    return Tenant.objects.get(name="acme")


def create_key(client, tenant="acme", **body):
    payload = {"name": "ci", **body}
    return client.post(f"/api/v1/tenants/{tenant}/keys/", payload, format="json")


def published() -> dict[str, dict]:
    raw = redis_client().hgetall(publish.KEYS_KEY)
    return {field.decode(): json.loads(value) for field, value in raw.items()}


def all_database_text() -> str:
    """Every row of every table as text: what a database dump would show."""
    chunks = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT t::text FROM "{table}" AS t')
            chunks.extend(row[0] for row in cursor.fetchall())
    return "\n".join(chunks)


def test_tenant_contract(api, acme):
    client = api("viewer")
    body = client.get("/api/v1/tenants/acme/").json()
    fields = ("name", "display_name", "rpm_limit", "tpm_limit", "max_concurrent", "active_keys")
    assert {k: body[k] for k in fields} == {
        "name": "acme", "display_name": "Acme Corp", "rpm_limit": 600, "tpm_limit": 100000, "max_concurrent": None,
        "active_keys": 0}
    assert [t["name"] for t in client.get("/api/v1/tenants/").json()["results"]] == ["acme"]
    response = api("operator").patch("/api/v1/tenants/acme/", {"max_concurrent": 8, "rpm_limit": None}, format="json")
    assert response.status_code == 200
    assert (response.json()["max_concurrent"], response.json()["rpm_limit"]) == (8, None)
    update = AuditEvent.objects.get(action="tenant.update")
    assert update.before["rpm_limit"] == 600 and update.after["max_concurrent"] == 8


def test_duplicate_tenant_is_a_conflict(api, acme):
    audits = AuditEvent.objects.count()
    response = api("operator").post("/api/v1/tenants/", {"name": "acme"}, format="json")
    assert response.status_code == 409 and "already exists" in response.json()["detail"]
    assert Tenant.objects.count() == 1 and AuditEvent.objects.count() == audits


def test_key_is_shown_once_and_stored_only_as_its_hash(api, acme, deployments, redis_conn):
    client = api("operator")
    response = create_key(client, deployments=["chat"], rpm_limit=60, priority=5)
    assert response.status_code == 201, response.content
    body = response.json()
    secret = body["key"]
    match = KEY_FORMAT.match(secret)
    assert match and match.group(1) == body["prefix"]
    assert {k: body[k] for k in ("name", "tenant", "deployments", "rpm_limit", "priority", "state")} == {
        "name": "ci", "tenant": "acme", "deployments": ["chat"], "rpm_limit": 60, "priority": 5, "state": "active"}

    key = ApiKey.objects.get(prefix=body["prefix"])
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    dump = all_database_text()
    assert secret not in dump and secret.split("_", 2)[2] not in dump
    audit = AuditEvent.objects.get(action="apikey.create")
    assert key.key_hash not in json.dumps(audit.after) and audit.after["prefix"] == key.prefix
    # Never again: not in the list, not in the detail.
    listed = client.get("/api/v1/tenants/acme/keys/").json()["results"]
    assert [k["prefix"] for k in listed] == [key.prefix] and "key" not in listed[0]
    assert "key" not in client.get(f"/api/v1/tenants/acme/keys/{key.prefix}/").json()
    assert secret not in json.dumps(listed)


def test_published_snapshot_holds_active_keys_with_both_levels_of_limits(api, acme, deployments, redis_conn):
    client = api("operator")
    expires = timezone.now() + timedelta(days=30)
    scoped = create_key(client, name="scoped", deployments=["chat", "embed"], rpm_limit=60, tpm_limit=5000,
                        max_concurrent=4, priority=10, expires_at=expires.isoformat()).json()
    open_key = create_key(client, name="open").json()
    revoked = create_key(client, name="revoked").json()
    expired = create_key(client, name="expired").json()
    client.delete(f"/api/v1/tenants/acme/keys/{revoked['prefix']}/")
    ApiKey.objects.filter(prefix=expired["prefix"]).update(expires_at=timezone.now() - timedelta(seconds=1))

    generation = int(redis_conn.get(KEYS_GENERATION_KEY) or 0)
    assert publish.publish_keys() == 2
    table = published()
    assert set(table) == {hashlib.sha256(k["key"].encode()).hexdigest() for k in (scoped, open_key)}
    entry = table[hashlib.sha256(scoped["key"].encode()).hexdigest()]
    assert entry == {
        "prefix": scoped["prefix"], "name": "scoped", "tenant": "acme", "deployments": ["chat", "embed"],
        "priority": 10, "expires_at": pytest.approx(expires.timestamp()),
        "limits": {"key": {"rpm": 60, "tpm": 5000, "max_concurrent": 4},
                   "tenant": {"rpm": 600, "tpm": 100000, "max_concurrent": None}},
    }
    open_entry = table[hashlib.sha256(open_key["key"].encode()).hexdigest()]
    assert open_entry["deployments"] == [] and open_entry["expires_at"] is None
    assert open_entry["limits"]["key"] == {"rpm": None, "tpm": None, "max_concurrent": None}
    assert int(redis_conn.get(KEYS_GENERATION_KEY)) == generation + 1

    # A flushed Redis heals on the beat's next run.
    redis_conn.delete(publish.KEYS_KEY)
    assert publish_keys_task() == 2 and set(published()) == set(table)


def test_every_change_is_published_on_commit_and_revoke_is_immediate(
        api, acme, redis_conn, django_capture_on_commit_callbacks):
    client = api("operator")
    pubsub = redis_conn.pubsub()
    pubsub.subscribe(KEYS_CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    with django_capture_on_commit_callbacks(execute=True):
        created = create_key(client).json()
    digest = hashlib.sha256(created["key"].encode()).hexdigest()
    assert digest in published()
    assert pubsub.get_message(timeout=1)["data"] == b"keys"

    with django_capture_on_commit_callbacks(execute=True):
        client.patch("/api/v1/tenants/acme/", {"tpm_limit": 42}, format="json")
    assert published()[digest]["limits"]["tenant"]["tpm"] == 42

    generation = int(redis_conn.get(KEYS_GENERATION_KEY))
    with django_capture_on_commit_callbacks(execute=True):
        response = client.delete(f"/api/v1/tenants/acme/keys/{created['prefix']}/")
    assert response.status_code == 204
    assert digest not in published()
    assert int(redis_conn.get(KEYS_GENERATION_KEY)) == generation + 1
    assert pubsub.get_message(timeout=1)["data"] == b"keys"
    pubsub.close()

    assert client.get(f"/api/v1/tenants/acme/keys/{created['prefix']}/").json()["state"] == "revoked"
    assert client.delete(f"/api/v1/tenants/acme/keys/{created['prefix']}/").status_code == 204
    assert AuditEvent.objects.filter(action="apikey.revoke").count() == 1
    assert client.get("/api/v1/tenants/acme/").json()["active_keys"] == 0


def test_roles(api, acme):
    assert api(None).get("/api/v1/tenants/").status_code == 401
    assert api(None).get("/api/v1/usage/").status_code == 401
    viewer = api("viewer")
    assert viewer.get("/api/v1/tenants/").status_code == 200
    assert viewer.get("/api/v1/tenants/acme/keys/").status_code == 200
    assert viewer.get("/api/v1/usage/").status_code == 200
    assert viewer.post("/api/v1/tenants/", {"name": "other"}, format="json").status_code == 403
    assert viewer.patch("/api/v1/tenants/acme/", {"rpm_limit": 1}, format="json").status_code == 403
    assert create_key(viewer).status_code == 403
    prefix = create_key(api("admin")).json()["prefix"]
    assert viewer.delete(f"/api/v1/tenants/acme/keys/{prefix}/").status_code == 403
    assert ApiKey.objects.get(prefix=prefix).revoked_at is None


@pytest.mark.parametrize("body,field,fragment", [
    ({"name": "Not A Slug"}, "name", "lowercase letters"),
    ({"name": ""}, "name", "may not be blank"),
    ({}, "name", "required"),
    ({"name": "t", "rpm_limit": 0}, "rpm_limit", "greater than or equal to 1"),
    ({"name": "t", "tpm_limit": -5}, "tpm_limit", "greater than or equal to 1"),
    ({"name": "t", "max_concurrent": "many"}, "max_concurrent", "valid integer"),
    ({"name": "t", "rpm_limit": 2**31}, "rpm_limit", "less than or equal to"),
    ({"name": "t", "rpm": 10}, "rpm", "Unknown field"),
])
def test_bad_tenant_input(api, body, field, fragment):
    response = api("operator").post("/api/v1/tenants/", body, format="json")
    assert response.status_code == 400
    assert fragment in " ".join(response.json()[field])
    assert not Tenant.objects.exists() and not AuditEvent.objects.exists()


def test_bad_tenant_update(api, acme):
    response = api("operator").patch("/api/v1/tenants/acme/", {"name": "renamed", "rpm_limit": 0}, format="json")
    assert response.status_code == 400 and set(response.json()) >= {"rpm_limit"}
    response = api("operator").patch("/api/v1/tenants/acme/", {"name": "renamed"}, format="json")
    assert response.status_code == 400 and "Unknown field" in response.json()["name"][0]
    assert Tenant.objects.get().rpm_limit == 600


@pytest.mark.parametrize("body,field,fragment", [
    ({"name": ""}, "name", "may not be blank"),
    ({"name": None}, "name", "may not be null"),
    ({"name": "x" * 101}, "name", "no more than 100"),
    ({"deployments": ["chat", "nope", "gone"]}, "deployments", "No deployment named 'nope', 'gone'"),
    ({"deployments": "chat"}, "deployments", "list"),
    ({"deployments": ["Bad Name"]}, "deployments", "lowercase letters"),
    ({"rpm_limit": 0}, "rpm_limit", "greater than or equal to 1"),
    ({"priority": 1001}, "priority", "less than or equal to 1000"),
    ({"priority": "high"}, "priority", "valid integer"),
    ({"expires_at": "next week"}, "expires_at", "Datetime has wrong format"),
    ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at", "in the future"),
    ({"scope": ["chat"]}, "scope", "Unknown field"),
])
def test_bad_key_input(api, acme, deployments, body, field, fragment):
    audits = AuditEvent.objects.count()
    response = create_key(api("operator"), **body)
    assert response.status_code == 400, response.content
    assert fragment in json.dumps(response.json()[field])  # a list item's error is keyed by its index
    assert not ApiKey.objects.exists() and AuditEvent.objects.count() == audits


def test_unknown_tenant_and_prefix_are_404(api, acme):
    client = api("operator")
    assert client.get("/api/v1/tenants/nope/").status_code == 404
    assert client.patch("/api/v1/tenants/nope/", {"rpm_limit": 5}, format="json").status_code == 404
    assert client.get("/api/v1/tenants/nope/keys/").status_code == 404
    assert create_key(client, tenant="nope").status_code == 404
    assert client.delete("/api/v1/tenants/acme/keys/deadbeef/").status_code == 404
    # A key is reached only through its own tenant.
    client.post("/api/v1/tenants/", {"name": "other"}, format="json")
    prefix = create_key(client).json()["prefix"]
    assert client.delete(f"/api/v1/tenants/other/keys/{prefix}/").status_code == 404
    assert ApiKey.objects.get(prefix=prefix).revoked_at is None
