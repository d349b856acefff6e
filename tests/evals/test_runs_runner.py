"""The runner on real replica processes of the tiny demo checkpoint, in this process: a deployment's
replicas scored case by case, a model version on temporary replicas that are gone afterwards, a cancel
while running, a failure in words, the claim, and the reaper of a run whose worker died.

The runner's thread and the test share the database, so these tests commit (transactional)."""

from __future__ import annotations

import threading

import httpx
import pytest
from django.utils import timezone

from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Replica
from deployments.replicas.drivers.local import find_replica_process, replica_marker
from evals.choices import RunStatus
from evals.models import EvalCaseResult, EvalRun
from evals.runs import runner, services
from evals.signals import run_finished
from inferops.models import installation_id
from tests.conftest import free_port
from tests.evals.runs_world import eval_set_with, register_tiny
from tests.services import Process
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = ["one two three", "the cat sat", "hello there", "count to five", "a b c d", "numbers go up"]


@pytest.fixture
def finished_runs():
    seen: list[tuple[int, str]] = []

    def receiver(sender, run, **kwargs):
        seen.append((run.pk, run.status))

    run_finished.connect(receiver, weak=False)
    yield seen
    run_finished.disconnect(receiver)


@pytest.fixture
def replica_process(tiny_llama_dir, tmp_path):
    """A real replica of the tiny checkpoint serving model name `chat`; yields its URL."""
    port = free_port()
    process = Process(["serve", "--model", str(tiny_llama_dir), "--port", str(port), "--served-model-name", "chat"],
                      tmp_path / "replica.log", f"http://127.0.0.1:{port}/health")
    try:
        process.wait_healthy()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.fixture
def deployment(tiny_llama_dir, replica_process, settings, tmp_path):
    """Deployment `chat` of tiny v1 with one ready replica: the real process above."""
    settings.INFEROPS_DATA_DIR = tmp_path
    version = register_tiny(tiny_llama_dir)
    deployment = deployment_services.deployment_create(name="chat", model=version.model, version=1, actor=None)
    Replica.objects.create(deployment=deployment, version=version, node="here", url=replica_process,
                           state=ReplicaState.READY)
    return deployment


def greedy(url: str, prompt: str, max_tokens: int = 8) -> str:
    body = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "chat", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0}).json()
    return body["choices"][0]["text"]


def cases_half_right(url: str) -> list[dict]:
    """Exact cases: the even ones expect the replica's own greedy answer, the odd ones something else."""
    return [{"id": f"c{i}", "prompt": prompt, "expected": greedy(url, prompt) if i % 2 == 0 else "never said"}
            for i, prompt in enumerate(PROMPTS)]


def test_a_deployment_run_scores_every_case(deployment, replica_process, finished_runs):
    set_version = eval_set_with(cases_half_right(replica_process))
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"},
                              concurrency=2)
    assert runner.execute_run(run.pk) == RunStatus.SUCCEEDED
    run.refresh_from_db()
    assert (run.done, run.total, run.score, run.error) == (6, 6, 0.5, "")
    assert run.scores == {"exact": {"cases": 6, "passed": 3, "score": 0.5}}
    cases = list(EvalCaseResult.objects.filter(run=run).order_by("index"))
    assert [(c.case_id, c.passed) for c in cases] == [(f"c{i}", i % 2 == 0) for i in range(6)]
    assert "expected 'never said'" in cases[1].reason
    assert run.prompt_tokens == sum(c.prompt_tokens for c in cases) > 0
    assert run.completion_tokens == sum(c.completion_tokens for c in cases) > 0
    assert set(run.latency_ms) == {"p50", "p90", "p95", "p99"}
    assert 0 < run.latency_ms["p50"] <= run.latency_ms["p90"] <= run.latency_ms["p99"]
    assert finished_runs == [(run.pk, RunStatus.SUCCEEDED)]
    # The claim: a redelivered task does nothing to a run that is no longer queued.
    assert runner.execute_run(run.pk) == "not queued"
    assert EvalCaseResult.objects.filter(run=run).count() == 6 and len(finished_runs) == 1


def temporary_replica_running(run_id: int, role: str) -> bool:
    return find_replica_process(replica_marker(installation_id(), runner.temporary_key(run_id, role))) is not None


def test_a_model_version_runs_on_temporary_replicas_that_are_gone_afterwards(tiny_llama_dir, settings, tmp_path,
                                                                              finished_runs):
    settings.INFEROPS_DATA_DIR = tmp_path
    version = register_tiny(tiny_llama_dir)
    cases = [{"id": "same-1", "prompt": "one two three"}, {"id": "same-2", "prompt": "the cat sat"},
             {"id": "wrong", "prompt": "hello", "scorer": "exact", "expected": "never said"}]
    set_version = eval_set_with(cases, scorer="parity")
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"model": "tiny", "version": 1},
                              reference=version)
    seen_running = []
    # Look while the run works: both temporary replicas (the version, and the same version as reference) run.
    watcher = threading.Thread(target=lambda: seen_running.extend(wait_until(
        lambda: [role for role in ("target", "reference") if temporary_replica_running(run.pk, role)] or None,
        "the temporary replicas to start", 60, 0.05)))
    watcher.start()
    assert runner.execute_run(run.pk) == RunStatus.SUCCEEDED
    watcher.join()
    run.refresh_from_db()
    assert (run.done, run.score) == (3, 2 / 3)
    assert run.scores["parity"] == {"cases": 2, "passed": 2, "score": 1.0, "token_agreement": 1.0, "identical": 2}
    assert seen_running
    assert not temporary_replica_running(run.pk, "target") and not temporary_replica_running(run.pk, "reference")
    assert finished_runs == [(run.pk, RunStatus.SUCCEEDED)]


def test_a_running_run_cancelled_stops_between_cases_and_keeps_them(deployment, finished_runs):
    cases = [{"id": f"c{i}", "prompt": f"tell me about {i}", "expected": "x", "max_tokens": 64} for i in range(60)]
    set_version = eval_set_with(cases)
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"},
                              concurrency=1)
    worker = threading.Thread(target=runner.execute_run, args=(run.pk,))
    worker.start()
    try:
        wait_until(lambda: EvalRun.objects.get(pk=run.pk).done >= 2, "two cases done", 60, 0.05)
        services.run_cancel(run=EvalRun.objects.get(pk=run.pk), actor=None)
    finally:
        worker.join(120)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert 2 <= run.done < 60 and run.error == f"Cancelled after {run.done} of 60 cases."
    assert EvalCaseResult.objects.filter(run=run).count() == run.done
    assert (run.score, run.scores) == (None, {})
    assert finished_runs == [(run.pk, RunStatus.CANCELLED)]


def test_a_deployment_without_a_ready_replica_fails_the_run_in_words(deployment, finished_runs):
    Replica.objects.filter(deployment=deployment).update(state=ReplicaState.FAILED)
    set_version = eval_set_with([{"id": "a", "prompt": "hi", "expected": "x"}])
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"})
    assert runner.execute_run(run.pk) == RunStatus.FAILED
    run.refresh_from_db()
    assert run.error.startswith("no ready replica of deployment chat serves tiny v1")
    assert finished_runs == [(run.pk, RunStatus.FAILED)]


def test_the_reaper_fails_a_run_whose_worker_died_and_kills_its_temporary_replica(tiny_llama_dir, settings,
                                                                                   tmp_path, finished_runs):
    settings.INFEROPS_DATA_DIR = tmp_path
    version = register_tiny(tiny_llama_dir)
    set_version = eval_set_with([{"id": "a", "prompt": "hi", "expected": "x"}])
    dead, alive = (services.run_create(eval_set=set_version.eval_set, actor=None,
                                       target={"model": "tiny", "version": 1}) for _ in range(2))
    assert runner.claim(dead.pk) and runner.claim(alive.pk)
    assert not runner.claim(dead.pk)  # a second claim of a running run wins nothing
    dead = EvalRun.objects.get(pk=dead.pk)
    # The worker started the run's temporary replica, then died: nothing beats or stops it any more.
    runner.TemporaryReplicas(dead, runner.Recorder(dead)).start("target", version, {})
    wait_until(lambda: temporary_replica_running(dead.pk, "target"), "the temporary replica's process")
    EvalRun.objects.filter(pk=dead.pk).update(heartbeat_at=timezone.now() - timezone.timedelta(minutes=5))
    assert runner.reap_stale_runs() == [dead.pk]
    dead.refresh_from_db()
    assert dead.status == RunStatus.FAILED
    assert dead.error.startswith("The worker running it stopped: no heartbeat for over 120 s")
    wait_until(lambda: not temporary_replica_running(dead.pk, "target"), "the orphaned replica killed")
    assert EvalRun.objects.get(pk=alive.pk).status == RunStatus.RUNNING
    assert runner.reap_stale_runs() == []
    assert finished_runs == [(dead.pk, RunStatus.FAILED)]


def test_a_nul_in_an_output_is_stored_as_a_replacement_character():
    assert runner.storable({"out\x00": ["a\x00b", 1, None]}) == {"out\ufffd": ["a\ufffdb", 1, None]}


def test_a_rollout_run_scores_the_candidate_replicas_only(deployment, replica_process):
    from deployments.models import Rollout

    # The stable replica answers nothing: a request sent to it would fail the run.
    Replica.objects.filter(deployment=deployment).update(url="http://127.0.0.1:9")
    rollout = Rollout.objects.create(deployment=deployment, stable_version=deployment.version,
                                     candidate_version=deployment.version, step_started_at=timezone.now(),
                                     steps=[{"set_weight": 20}])
    Replica.objects.create(deployment=deployment, version=deployment.version, node="here", url=replica_process,
                           state=ReplicaState.READY, rollout=rollout)
    set_version = eval_set_with([{"id": "a", "prompt": "hello", "expected": greedy(replica_process, "hello")}])
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"rollout": rollout.pk})
    assert runner.execute_run(run.pk) == RunStatus.SUCCEEDED
    assert EvalRun.objects.get(pk=run.pk).score == 1.0
