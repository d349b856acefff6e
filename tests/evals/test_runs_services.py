"""Starting and cancelling eval runs through the service: every bad field refused by name, nothing written
for a refusal, the task enqueued on commit, and the latest-score readers."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from deployments import services as deployment_services
from deployments.models import Deployment, Rollout
from evals.choices import RunStatus, TargetKind
from evals.models import EvalRun
from evals.runs import services
from inferops.api import Conflict
from tests.evals.runs_world import eval_set_with, register_tiny

pytestmark = pytest.mark.django_db

CASES = [{"id": "a", "prompt": "one two", "expected": "three"}, {"id": "b", "prompt": "four", "expected": "five"}]


@pytest.fixture
def world(tiny_llama_dir):
    version = register_tiny(tiny_llama_dir)
    set_version = eval_set_with(CASES)
    deployment = deployment_services.deployment_create(name="chat", model=version.model, version=1, actor=None)
    return set_version, deployment


def refused(**kwargs) -> dict:
    with pytest.raises(ValidationError) as caught:
        services.run_create(actor=None, **kwargs)
    assert not EvalRun.objects.exists()
    return caught.value.message_dict


def test_a_deployment_run_takes_its_version_and_defaults(world, django_capture_on_commit_callbacks, monkeypatch):
    set_version, deployment = world
    sent = []
    monkeypatch.setattr(services, "enqueue", lambda name, *args: sent.append((name, *args)))
    with django_capture_on_commit_callbacks(execute=True):
        run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"})
    assert (run.status, run.target_kind, run.deployment, run.deployment_name) == (
        RunStatus.QUEUED, TargetKind.DEPLOYMENT, deployment, "chat")
    assert (run.model_version, run.set_version, run.total) == (deployment.version, set_version, 2)
    assert (run.priority, run.concurrency) == (-1000, 4)
    assert sent == [("evals.execute_run", run.pk)]


def test_a_model_version_target(world):
    set_version, deployment = world
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"model": "tiny", "version": 1},
                              priority=5, concurrency=32)
    assert (run.target_kind, run.model_version, run.deployment, run.priority, run.concurrency) == (
        TargetKind.VERSION, deployment.version, None, 5, 32)


def test_every_bad_field_is_named(world):
    set_version, _ = world
    eval_set = set_version.eval_set
    errors = refused(eval_set=eval_set, target={"deployment": "nope"}, priority=1001, concurrency=0)
    assert set(errors) == {"target", "priority", "concurrency"}
    assert "No deployment named 'nope'" in errors["target"][0]
    for target, says in [
        ({}, "exactly one of"), ({"deployment": "chat", "model": "tiny"}, "exactly one of"), ("chat", "object"),
        ({"model": "tiny"}, "needs its version"), ({"model": "tiny", "version": 9}, "has no version 9"),
        ({"model": "ghost", "version": 1}, "No model named 'ghost'"), ({"model": "tiny", "version": "1"}, "integer"),
        ({"deployment": "chat", "replicas": 2}, "Unknown key(s) replicas"), ({"rollout": 999}, "No rollout 999"),
        ({"rollout": 1, "track": "stable"}, 'track must be "canary"'),
    ]:
        assert says in refused(eval_set=eval_set, target=target)["target"][0], target
    assert "from 1 to 32" in refused(eval_set=eval_set, target={"deployment": "chat"}, concurrency=33)["concurrency"][0]
    assert "-1000 to 1000" in refused(eval_set=eval_set, target={"deployment": "chat"}, priority=-1001)["priority"][0]
    other = eval_set_with(CASES, name="other")
    assert "not a version of eval set 'smoke'" in refused(
        eval_set=eval_set, set_version=other, target={"deployment": "chat"})["set_version"][0]


def test_a_set_without_versions_and_parity_without_reference_are_refused(world):
    set_version, deployment = world
    from evals.models import EvalSet

    empty = EvalSet.objects.create(name="empty", scorer="exact")
    assert "has no version yet" in refused(eval_set=empty, target={"deployment": "chat"})["set_version"][0]
    parity = eval_set_with([{"id": "p", "prompt": "hello"}], name="same", scorer="parity")
    assert "give reference" in refused(eval_set=parity.eval_set, target={"deployment": "chat"})["reference"][0]
    run = services.run_create(eval_set=parity.eval_set, actor=None, target={"deployment": "chat"},
                              reference=deployment.version)
    assert run.reference_version == deployment.version


def test_a_rollout_target_must_be_active(world):
    set_version, deployment = world
    rollout = Rollout.objects.create(deployment=deployment, stable_version=deployment.version,
                                     candidate_version=deployment.version, candidate_engine_args={"max_num_seqs": 4},
                                     step_started_at=timezone.now(), steps=[{"set_weight": 20}])
    run = services.run_create(eval_set=set_version.eval_set, actor=None, target={"rollout": rollout.pk})
    assert (run.target_kind, run.rollout, run.track, run.engine_args) == (
        TargetKind.ROLLOUT, rollout, "canary", {"max_num_seqs": 4})
    Rollout.objects.filter(pk=rollout.pk).update(status="aborted")
    EvalRun.objects.all().delete()
    assert "is aborted" in refused(eval_set=set_version.eval_set, target={"rollout": rollout.pk})["target"][0]


def test_cancel_a_queued_run_at_once_and_a_running_one_by_request(world):
    set_version, _ = world
    queued = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"})
    cancelled = services.run_cancel(run=queued, actor=None)
    assert (cancelled.status, cancelled.cancel_requested) == (RunStatus.CANCELLED, True)
    with pytest.raises(Conflict):
        services.run_cancel(run=queued, actor=None)
    running = services.run_create(eval_set=set_version.eval_set, actor=None, target={"deployment": "chat"})
    EvalRun.objects.filter(pk=running.pk).update(status=RunStatus.RUNNING)
    asked = services.run_cancel(run=running, actor=None)
    assert (asked.status, asked.cancel_requested) == (RunStatus.RUNNING, True)


def test_latest_run_and_deployment_score_read_succeeded_runs_only(world):
    set_version, deployment = world
    assert services.deployment_score(deployment) is None
    older, newer, failed = (services.run_create(eval_set=set_version.eval_set, actor=None,
                                                target={"deployment": "chat"}) for _ in range(3))
    now = timezone.now()
    EvalRun.objects.filter(pk__in=[older.pk, newer.pk]).update(status=RunStatus.SUCCEEDED, finished_at=now)
    EvalRun.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED, finished_at=now)
    assert services.deployment_score(Deployment.objects.get(pk=deployment.pk)) == newer
    assert services.latest_run(model_version=deployment.version, set_version=set_version) == newer
    assert services.latest_run(model_version=deployment.version, eval_set=eval_set_with(CASES, name="x").eval_set) \
        is None
