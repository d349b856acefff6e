"""A quality SLO end to end on a real Celery worker with beat: a deployment deployed through the API
serves its real replica, an operator defines a quality SLO through the API, beat's start-quality-runs
starts a scheduled run, the worker scores it on the replica, the run's cases land in the SLO's minute
row at its finish, and the SLO's status, its eval runs and its page (the score is under the floor)
show it.

The worker processes connect to the test database, so this test commits (transactional)."""

from __future__ import annotations

import os
import signal

import pytest

from alerts.models import Alert
from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from evals.models import EvalRun
from inferops.celery import app as celery_app
from slo.budget import floor_minute
from slo.models import SloMinute
from tests.evals.runs_world import deployed_with_half_right_set, register_tiny
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

def test_beat_scores_a_quality_slo_on_a_real_replica_and_it_pages_under_the_floor(api, tiny_llama_dir, worker_env,
                                                                                  tmp_path):
    operator = api("operator")
    register_tiny(tiny_llama_dir)
    celery_app.control.purge()  # messages other tests queued on this Redis database are not this test's
    worker = start_worker(worker_env, tmp_path, "quality")
    log = tmp_path / "quality.log"
    try:
        deployed_with_half_right_set(operator, log)
        created = operator.post("/api/v1/slos/", {
            "name": "e2e-quality", "deployment": "e2e", "objective": 0.9, "window": "1d", "min_requests": 5,
            "sli": {"kind": "quality", "eval_set": "e2e-set", "every": "6h"}}, format="json")
        assert created.status_code == 201, created.content
        slo_id = created.json()["id"]

        # Beat's start-quality-runs (every minute) starts the run; the worker scores it.
        run = wait_until(lambda: EvalRun.objects.filter(trigger="slo", status__in=("succeeded", "failed")).first(),
                         lambda: f"the scheduled run to finish: {list(EvalRun.objects.values('status', 'error'))}\n"
                                 f"{log.read_text()[-3000:]}", 240, 0.5)
        assert (run.status, run.deployment_name, run.done, run.score) == ("succeeded", "e2e", 7, 4 / 7)
        status = wait_until(
            lambda: (body := operator.get(f"/api/v1/slos/{slo_id}/status/").json())["total"] == 7 and body,
            lambda: f"the run counted into the SLO: {operator.get(f'/api/v1/slos/{slo_id}/status/').json()}\n"
                    f"{log.read_text()[-3000:]}", 60, 0.5)
        minute = SloMinute.objects.get(slo_id=slo_id)
        assert (minute.minute, minute.good, minute.total) == (floor_minute(run.finished_at), 4, 7)
        assert (status["good"], status["sli"]) == (4, 4 / 7)
        assert status["status"] == "exhausted"  # 3 failed cases of the 0.7 allowed
        [page] = status["alerts"]
        assert (page["severity"], page["labels"]["alertname"]) == ("page", "SloQualityBelowFloor")
        assert page["annotations"]["failing_cases_url"].endswith(f"/evals/runs/{run.pk}/")
        assert Alert.objects.get().slo_id == slo_id

        runs = operator.get(f"/api/v1/slos/{slo_id}/eval-runs/").json()["runs"]
        assert [(r["run"], r["passed"], r["cases"], r["url"]) for r in runs] == [
            (run.pk, 4, 7, f"/evals/runs/{run.pk}/")]
        shown = operator.get(f"/api/v1/slos/{slo_id}/").json()["quality"]
        assert shown["floor"] == 0.9 and shown["latest_run"]["run"] == run.pk
        # Scored every 6 h: the next ticks start nothing.
        assert EvalRun.objects.filter(trigger="slo").count() == 1
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        for leftover in Replica.objects.all():
            LocalProcessDriver().kill(leftover)
