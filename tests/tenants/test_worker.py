"""A real Celery worker with beat: keys republished after Redis lost them, usage ingested from
the stream into the ledger with replays counted once.

The worker connects to the test database, so this test commits (transactional)."""

from __future__ import annotations

import hashlib

import pytest

from tenants import ingest, publish, services
from tenants.models import UsageEvent, UsageMinute
from tests.processes import stop_process
from tests.services import start_worker
from tests.tenants.conftest import usage_event, xadd_events
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def everything_acked(client) -> bool:
    """Every entry delivered to the group (the replays too) and none left pending."""
    group = client.xinfo_groups(ingest.STREAM_KEY)[0]
    last = client.xinfo_stream(ingest.STREAM_KEY)["last-generated-id"]
    return group["last-delivered-id"] == last and group["pending"] == 0


def test_beat_republishes_keys_and_ingests_usage(worker_env, tmp_path, redis_conn):
    tenant = services.tenant_create(name="acme", actor=None, rpm_limit=60)
    key, secret = services.key_create(tenant=tenant, name="ci", actor=None)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert redis_conn.hexists(publish.KEYS_KEY, digest)  # published on commit
    redis_conn.delete(publish.KEYS_KEY)  # Redis restarted empty

    events = [usage_event(tenant="acme", key_prefix=key.prefix, prompt_tokens=i) for i in range(300)]
    xadd_events(redis_conn, events + events[:40])  # a spool replay of the first 40
    env = {**worker_env, "INFEROPS_KEYS_PUBLISH_INTERVAL_S": "1", "INFEROPS_USAGE_INGEST_INTERVAL_S": "1"}
    worker = start_worker(env, tmp_path, "tenants")
    try:
        log = lambda: (tmp_path / "tenants.log").read_text()[-3000:]  # noqa: E731
        wait_until(lambda: redis_conn.hexists(publish.KEYS_KEY, digest), lambda: f"the keys republished\n{log()}",
                   60, 0.5)
        wait_until(lambda: UsageEvent.objects.count() == 300 and everything_acked(redis_conn),
                   lambda: f"300 events stored and acked ({UsageEvent.objects.count()} stored)\n{log()}", 60, 0.5)
    finally:
        stop_process(worker, 30)
    rows = UsageMinute.objects.filter(tenant="acme")
    assert sum(r.requests for r in rows) == 300
    assert sum(r.prompt_tokens for r in rows) == sum(range(300))
