"""A real Celery worker and beat run the replicas: deploy through the API, serve, scrape, restart.

The worker processes connect to the test database, so this test commits (transactional).
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.models import Replica, ReplicaMetricsMinute
from deployments.replicas.drivers.local import LocalProcessDriver
from registry import services as registry_services
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_worker_deploys_serves_scrapes_and_survives_a_restart(api, tiny_llama_dir, worker_env, tmp_path):
    operator = api("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=None)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    worker = start_worker(worker_env, tmp_path, "first")
    try:
        response = operator.post("/api/v1/deployments/", {"name": "e2e", "model": "tiny", "version": 1},
                                 format="json")
        assert response.status_code == 201
        wait_until(lambda: operator.get("/api/v1/deployments/e2e/").json()["up_to_date"],
                   lambda: f"the deployment to be ready: {operator.get('/api/v1/deployments/e2e/replicas/').json()} "
                           f"{(tmp_path / 'first.log').read_text()[-3000:]}", 90, 0.5)
        replica = Replica.objects.get(deployment__name="e2e", state=ReplicaState.READY)
        # Wait for the scraper's baseline, so every request below lands in a counted delta.
        wait_until(lambda: Replica.objects.get(pk=replica.pk).scrape_state, "the first scrape", 30, 0.5)

        sent = 6
        for _ in range(sent):
            body = httpx.post(f"{replica.url}/v1/completions", timeout=30, json={
                "model": "e2e", "prompt": "count the tokens", "max_tokens": 5, "ignore_eos": True}).json()
            assert body["usage"]["completion_tokens"] == 5

        def stored():
            rows = ReplicaMetricsMinute.objects.filter(replica=replica)
            tokens = sum(row.generation_tokens for row in rows)
            requests = sum(sum(row.requests_by_reason.values()) for row in rows)
            return (tokens, requests) == (sent * 5, sent)
        wait_until(stored, lambda: "the scraped metrics of every request: " + str(list(
            ReplicaMetricsMinute.objects.filter(replica=replica).values("generation_tokens", "requests_by_reason"))),
            30, 0.5)

        # SIGKILL the worker (and its beat) mid-flight; a new worker re-adopts the running replica.
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        pid = replica.identity["pid"]
        assert LocalProcessDriver().is_alive(replica)
        restarted = timezone.now()
        worker = start_worker(worker_env, tmp_path, "second")
        # Several reconcile passes of the new worker: each health-checks the ready replica.
        wait_until(lambda: Replica.objects.filter(pk=replica.pk, last_health_at__gt=restarted + timedelta(seconds=3))
                   .exists(),
                   lambda: f"the new worker's reconcile passes\n{(tmp_path / 'second.log').read_text()[-3000:]}",
                   60, 0.5)
        live = Replica.objects.filter(deployment__name="e2e").exclude(state=ReplicaState.STOPPED)
        assert [(r.pk, r.identity["pid"], r.state) for r in live] == [(replica.pk, pid, ReplicaState.READY)]

        assert operator.delete("/api/v1/deployments/e2e/").status_code == 202
        wait_until(lambda: operator.get("/api/v1/deployments/e2e/").status_code == 404, "the deployment removed",
                   60, 0.5)
        assert not LocalProcessDriver().is_alive(replica)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        for leftover in Replica.objects.all():
            LocalProcessDriver().kill(leftover)
