"""Issue 6 end to end: injected latency burns a TTFT SLO, a page alert opens and its webhook
arrives; the latency is removed and the alert resolves.

Real parts: a replica process (`inferops serve`, fault injection through its admin API), a
gateway process, Redis, Postgres, usage ingestion, SLO evaluation and webhook delivery to an HTTP
receiver in this test. The beat schedule is replaced by calling the same functions in a loop, and
notification tasks run eagerly, so the test controls the clock of each step.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from alerts.models import Alert, Receiver
from deployments import services as deployment_services
from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from inferops.celery import app as celery_app
from registry import services as registry_services
from slo.evaluation import evaluate_slos
from slo.services import slo_create
from tenants import services as tenant_services
from tenants.ingest import ingest_usage
from tenants.publish import publish_keys
from tests.deployments.test_reconcile import all_ready, reconcile_until
from tests.e2e.conftest import gateway_client
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ADMIN_TOKEN = "game-day-token"


class Receiver_(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    Receiver_.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver_)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", Receiver_.received
    server.shutdown()


def page_alert(received: list[dict], status: str) -> dict | None:
    """The page alert in that status from the first webhook carrying it (the ticket alert may share it)."""
    return next((alert for p in received for alert in p["alerts"]
                 if alert["status"] == status and alert["labels"]["severity"] == "page"), None)


def test_injected_latency_pages_and_resolves(private_redis, webhook, tmp_path, settings, monkeypatch,
                                             make_user, tiny_llama_dir):
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"health_timeout_s": 1}
    # Ticket and page alerts share a group; whichever opens second joins it at once, not group_interval later.
    settings.INFEROPS_ALERT_GROUP_INTERVAL_S = 0
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", ADMIN_TOKEN)  # inherited by the replica process
    celery_app.conf.task_always_eager = True
    # Tasks queued by name run eagerly only once registered: run alone, nothing had imported alerts.tasks.
    celery_app.loader.import_default_modules()
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor)
    tenant = tenant_services.tenant_create(name="acme", actor=actor)
    _, key = tenant_services.key_create(tenant=tenant, name="load", actor=actor)
    publish_keys()
    hook_url, received = webhook
    Receiver.objects.create(name="test-receiver", url=hook_url, send_resolved=True)
    slo = slo_create(actor=actor, name="chat-ttft", scope="deployment", deployment=deployment, sli_kind="latency",
                     ttft_ms=150, objective=0.99, window="1d", budgeting="occurrences", min_requests=10)
    gateway = None
    try:
        reconcile_until(deployment, all_ready(1))
        replica = Replica.objects.get(deployment=deployment, state="ready")
        gateway, base, client = gateway_client(private_redis.url, tmp_path / "spool", key)

        stop_load = threading.Event()

        def load():
            while not stop_load.is_set():
                for _chunk in client.chat.completions.create(model="chat", max_tokens=4, stream=True,
                                                            messages=[{"role": "user", "content": "hi"}]):
                    pass
                time.sleep(0.2)

        def set_fault(ms: float):
            response = httpx.post(f"{replica.url}/admin/faults", json={"fault_ttft_ms": ms},
                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
            assert response.status_code == 200, response.text

        def cycle() -> Alert | None:
            ingest_usage(budget_s=5)
            evaluate_slos()
            return Alert.objects.filter(slo=slo, severity="page").order_by("-id").first()

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        set_fault(400)
        fault_on = time.monotonic()
        alert = wait_until(lambda: (a := cycle()) and a.status == "firing" and a, "the page alert to open", 300, 0.2)
        opened_after = time.monotonic() - fault_on
        # A burn this fast opens the ticket alert too, in either order and either cycle.
        firing = wait_until(lambda: page_alert(received, "firing"), "the firing page webhook", 30, 0.2)
        assert firing["labels"]["slo"] == "chat-ttft" and all(p["version"] == "4" for p in received)

        set_fault(0)
        fault_off = time.monotonic()
        wait_until(lambda: (a := cycle()) and a.status == "resolved" and a.pk == alert.pk,
                   "the page alert to resolve", 300, 0.2)
        resolved_after = time.monotonic() - fault_off
        wait_until(lambda: page_alert(received, "resolved"), "the resolved page webhook", 30, 0.2)
        stop_load.set()
        loader.join(timeout=30)  # its last request must end before the gateway is killed
        print(f"timeline: page alert opened {opened_after:.0f}s after 400 ms of TTFT was injected; "
              f"resolved {resolved_after:.0f}s after it was removed; {len(received)} webhook deliveries")
        assert Alert.objects.filter(slo=slo, severity="page").count() == 1  # opened once, updated, resolved
    finally:
        celery_app.conf.task_always_eager = False
        if gateway is not None and gateway.poll() is None:
            gateway.send_signal(signal.SIGKILL)
        for leftover in Replica.objects.all():
            LocalProcessDriver().kill(leftover)
