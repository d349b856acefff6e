"""The evals app's side of the rollout quality step (evals/rollout_quality.py) on real rows: which runs it
starts (the candidate through the rollout, the stable spec only when it has no score of its own), and its
verdict as those runs move. The runs' task is not run here (the enqueue is recorded): each test moves a
run's row where the runner would; tests/e2e/test_rollout_quality_e2e.py runs them for real."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.utils import timezone

from deployments.choices import Verdict
from deployments.rollouts.spec import normalise
from evals.choices import RunStatus, TargetKind, Trigger
from evals.models import EvalRun
from evals.rollout_quality import LATEST, PARITY, STARTED, EvalsRolloutQuality
from evals.runs import services as run_services
from tests.deployments.conftest import start
from tests.evals.runs_world import eval_set_with

pytestmark = pytest.mark.django_db(transaction=True)

EXACT = [{"id": "a", "prompt": "one two", "expected": "three"}, {"id": "b", "prompt": "four", "expected": "five"}]
PARITY_CASES = [{"id": "a", "prompt": "one two"}, {"id": "b", "prompt": "four"}]


@pytest.fixture
def enqueued(monkeypatch):
    sent = []
    monkeypatch.setattr(run_services, "enqueue", lambda name, *args: sent.append((name, *args)))
    return sent


def step(**config) -> dict:
    """A quality step's config as the rollout keeps it."""
    steps, _ = normalise("canary", steps=[{"quality": {"eval_set": "facts", **config}}])
    return steps[0]["quality"]


def parked(world):
    """A canary of v2 paused before any traffic: its candidate exists to be scored."""
    rollout = start(world, version=2, steps=[{"pause": {}}, {"quality": step(max_drop=0.05)}])
    world.tick()
    return rollout


def finish(run_id: int, score: float | None, status=RunStatus.SUCCEEDED, error="") -> None:
    run = EvalRun.objects.get(pk=run_id)
    EvalRun.objects.filter(pk=run_id).update(status=status, score=score, done=run.total, error=error,
                                             finished_at=timezone.now())


def test_the_eval_set_and_its_version_must_exist():
    quality = EvalsRolloutQuality()
    assert quality.validate(step(max_drop=0.1)) == ["eval_set: no eval set named 'facts'"]
    eval_set_with(EXACT, name="facts")
    assert quality.validate(step(max_drop=0.1)) == []
    assert quality.validate(step(max_drop=0.1, set_version=1)) == []
    assert quality.validate(step(max_drop=0.1, set_version=2)) == ["set_version: 'facts' has no version 2"]


def test_a_parity_set_scores_the_candidate_against_the_stable_version_whose_score_is_one(world, enqueued):
    eval_set_with(PARITY_CASES, name="facts", scorer="parity")
    rollout = parked(world)
    quality = EvalsRolloutQuality()
    config = step(max_drop=0.05, min_score=0.8)
    state = quality.start(rollout, config)
    run = EvalRun.objects.get()
    assert state == {"set_version": 1, "runs": {"candidate": run.pk}, "stable_basis": PARITY}
    assert (run.target_kind, run.rollout, run.track, run.model_version.number) == (
        TargetKind.ROLLOUT, rollout, "canary", 2)
    assert (run.reference_version.number, run.priority, run.trigger) == (1, -1000, Trigger.ROLLOUT)

    look = quality.verdict(rollout, config, state)
    assert look.verdict == Verdict.RUNNING and look.link == ""
    assert look.reason == (f"facts v1: candidate run {run.pk} queued, 0/2 cases; "
                           "stable 1.00 by definition (parity with it)")
    finish(run.pk, 0.5)
    look = quality.verdict(rollout, config, state)
    assert look.verdict == Verdict.FAIL
    assert look.reason == ("quality facts: candidate 0.50, stable 1.00 (drop 0.50): under the floor 0.80 and a "
                           "drop of 0.50 over the limit 0.05")
    assert look.link == f"{settings.INFEROPS_EXTERNAL_URL}/evals/runs/{run.pk}/?passed=false"
    assert look.candidate["score"] == 0.5 and look.stable == {"run": None, "score": 1.0, "basis": PARITY}
    finish(run.pk, 1.0)
    assert quality.verdict(rollout, config, state).verdict == Verdict.PASS


def test_the_stable_specs_latest_score_on_the_same_set_version_is_the_baseline(world, enqueued):
    set_version = eval_set_with(EXACT, name="facts")
    rollout = parked(world)
    earlier = run_services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"})
    finish(earlier.pk, 1.0)
    quality = EvalsRolloutQuality()
    config = step(max_drop=0.05)
    state = quality.start(rollout, config)
    candidate = EvalRun.objects.get(target_kind=TargetKind.ROLLOUT)
    assert candidate.reference_version is None  # no parity case: nothing to compare outputs with
    assert state == {"set_version": 1, "runs": {"candidate": candidate.pk, "stable": earlier.pk},
                     "stable_basis": LATEST}
    assert EvalRun.objects.count() == 2  # nothing started on stable
    assert f"stable 1.00 (its latest run, {earlier.pk})" in quality.verdict(rollout, config, state).reason
    finish(candidate.pk, 0.5)
    look = quality.verdict(rollout, config, state)
    assert look.verdict == Verdict.FAIL and "candidate 0.50, stable 1.00 (drop 0.50)" in look.reason
    assert look.stable["run"] == earlier.pk and look.stable["basis"] == LATEST


def test_without_a_stable_score_a_run_on_the_stable_replicas_starts_beside_the_candidates(world, enqueued):
    set_version = eval_set_with(EXACT, name="facts")
    eval_set_with(EXACT, name="facts")  # v2: the step names v1
    rollout = parked(world)
    # A run of the stable version with other engine args scored something else: it does not count.
    other = run_services.run_create(eval_set=set_version.eval_set, set_version=set_version, actor=None,
                                    target={"deployment": "chat"})
    EvalRun.objects.filter(pk=other.pk).update(engine_args={"dtype": "int8"})
    finish(other.pk, 1.0)
    quality = EvalsRolloutQuality()
    config = step(max_drop=0.05, min_score=0.8, set_version=1)
    state = quality.start(rollout, config)
    candidate = EvalRun.objects.get(target_kind=TargetKind.ROLLOUT)
    stable = EvalRun.objects.exclude(pk__in=[other.pk, candidate.pk]).get()
    assert state["runs"] == {"candidate": candidate.pk, "stable": stable.pk} and state["stable_basis"] == STARTED
    assert (stable.target_kind, stable.deployment_name, stable.set_version.number, stable.trigger) == (
        TargetKind.DEPLOYMENT, "chat", 1, Trigger.ROLLOUT)
    assert candidate.set_version.number == 1
    assert [name for name, *_ in enqueued] == ["evals.execute_run"] * 3

    finish(candidate.pk, 0.9)
    look = quality.verdict(rollout, config, state)  # the floor holds; the drop waits for the stable score
    assert look.verdict == Verdict.RUNNING
    assert look.reason == f"candidate scored 0.90; stable run {stable.pk} queued, 0/2 cases"
    finish(stable.pk, 1.0)
    look = quality.verdict(rollout, config, state)
    assert look.verdict == Verdict.FAIL and "a drop of 0.10 over the limit 0.05" in look.reason

    finish(candidate.pk, 0.5)
    EvalRun.objects.filter(pk=stable.pk).update(status=RunStatus.RUNNING)
    look = quality.verdict(rollout, config, state)  # under the floor: no need to wait for stable
    assert look.verdict == Verdict.FAIL and look.reason == "quality facts: candidate 0.50: under the floor 0.80"


def test_a_run_that_fails_leaves_the_step_inconclusive_and_stop_cancels_the_candidates_run(world, enqueued):
    eval_set_with(EXACT, name="facts")
    rollout = parked(world)
    quality = EvalsRolloutQuality()
    config = step(max_drop=0.05)
    state = quality.start(rollout, config)
    candidate, stable = state["runs"]["candidate"], state["runs"]["stable"]
    finish(stable, None, RunStatus.FAILED, "replica unreachable")
    look = quality.verdict(rollout, config, state)
    assert look.verdict == Verdict.INCONCLUSIVE
    assert look.reason == f"the stable's eval run {stable} failed: replica unreachable."

    quality.stop(state)
    assert EvalRun.objects.get(pk=candidate).status == RunStatus.CANCELLED  # it was queued: cancelled at once
    quality.stop(state)  # and again: nothing left to cancel
