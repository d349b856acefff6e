"""An eval run end to end on a real Celery worker (with beat): a deployment deployed through the API
serves its replica, an operator starts a run through the API, the worker scores every case on that
replica, and the API shows the progress, the scores, the failing cases, tokens and latency.

The worker processes connect to the test database, so this test commits (transactional)."""

from __future__ import annotations

import os
import signal

import pytest

from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from tests.evals.runs_world import deployed_with_half_right_set, register_tiny
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

def test_a_worker_scores_a_deployment_through_the_api(api, tiny_llama_dir, worker_env, tmp_path):
    operator = api("operator")
    register_tiny(tiny_llama_dir)
    worker = start_worker(worker_env, tmp_path, "evals")
    log = tmp_path / "evals.log"
    try:
        deployed_with_half_right_set(operator, log)

        started = operator.post("/api/v1/evals/runs/", {"eval_set": "e2e-set", "target": {"deployment": "e2e"},
                                                        "concurrency": 3}, format="json")
        assert started.status_code == 202, started.content
        url = started.json()["links"]["self"]
        run = wait_until(lambda: (body := operator.get(url).json())["status"] in ("succeeded", "failed") and body,
                         lambda: f"the run to finish: {operator.get(url).json()}\n{log.read_text()[-3000:]}", 120, 0.5)
        assert (run["status"], run["error"], run["progress"]) == ("succeeded", "", {"done": 7, "total": 7})
        assert run["scores"] == {"exact": {"cases": 7, "passed": 4, "score": 4 / 7}} and run["score"] == 4 / 7
        assert run["prompt_tokens"] > 0 and run["completion_tokens"] > 0
        assert 0 < run["latency_ms"]["p50"] <= run["latency_ms"]["p95"] <= run["latency_ms"]["p99"]
        failing = operator.get(run["links"]["failing_cases"]).json()
        assert [case["id"] for case in failing["results"]] == ["c1", "c3", "c5"]
        assert all(case["reason"].startswith("expected 'nope', got ") for case in failing["results"])
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        for leftover in Replica.objects.all():
            LocalProcessDriver().kill(leftover)
