"""A version registered for a model with default eval sets is scored on each of them by itself, once
the registration has committed; a set that cannot be run is logged and never breaks the registration.

Transactional: the runs start from a real commit's on_commit hook, as in production. No worker runs:
each run stays queued, its task waiting in this test's Redis database.
"""

from __future__ import annotations

import logging

import pytest
from django.db import transaction

from evals import registration
from evals.choices import RunStatus, TargetKind, Trigger
from evals.models import EvalRun, EvalSet
from registry import services as registry_services
from registry.models import ModelVersion
from tests.evals.runs_world import eval_set_with

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def model(make_user):
    """Model `tiny` whose default sets are `qa` (exact, two versions), `same` (parity) and `draft`
    (no version yet); `other` is a default of no model."""
    model = registry_services.model_create(name="tiny", task="generate", actor=None)
    eval_set_with([{"id": "a", "prompt": "1+1=", "expected": "2"}], name="qa")
    eval_set_with([{"id": "a", "prompt": "1+1=", "expected": "2"}, {"id": "b", "prompt": "2+2=", "expected": "4"}],
                  name="qa")
    eval_set_with([{"id": "p", "prompt": "Once upon"}], name="same", scorer="parity")
    eval_set_with([{"id": "o", "prompt": "x", "expected": "y"}], name="other")
    EvalSet.objects.create(name="draft", scorer="exact")
    for name in ("qa", "same", "draft"):
        EvalSet.objects.get(name=name).default_for.add(model)
    return model


def register(model, checkpoint, actor=None) -> ModelVersion:
    return registry_services.version_register(model=model, artifact_uri=str(checkpoint), actor=actor)


def test_a_new_version_is_scored_on_each_default_set_once_registered(model, tiny_llama_dir, make_user, caplog):
    ci = make_user("operator", "ci-bot")
    with caplog.at_level(logging.WARNING, logger="evals.registration"):
        v1 = register(model, tiny_llama_dir, ci)
    run = EvalRun.objects.get()  # `same` needs a reference for parity and v1 has no parent
    assert (run.eval_set.name, run.set_version.number, run.status) == ("qa", 2, RunStatus.QUEUED)
    assert (run.target_kind, run.model_version, run.trigger, run.total) == (TargetKind.VERSION, v1, Trigger.REGISTER, 2)
    assert run.created_by == ci and run.reference_version is None
    assert "not scoring tiny v1 on eval set draft: set_version: Eval set 'draft' has no version yet" in caplog.text
    assert "not scoring tiny v1 on eval set same: reference: same v1 has parity cases" in caplog.text

    v2 = register(model, tiny_llama_dir)
    runs = {run.eval_set.name: run for run in EvalRun.objects.filter(model_version=v2)}
    assert sorted(runs) == ["qa", "same"]
    assert runs["same"].reference_version == v1  # parity compares the new version with the one it follows
    assert runs["qa"].reference_version is None and runs["qa"].created_by is None


def test_nothing_starts_before_the_commit_nor_when_the_registration_rolls_back(model, tiny_llama_dir):
    with pytest.raises(RuntimeError), transaction.atomic():
        register(model, tiny_llama_dir)
        assert not EvalRun.objects.exists()  # registered, not yet committed: nothing started
        raise RuntimeError("the registration's transaction fails after the row")
    assert not ModelVersion.objects.exists() and not EvalRun.objects.exists()


def test_a_run_that_fails_to_start_is_logged_and_the_registration_stands(model, tiny_llama_dir, api, monkeypatch,
                                                                          caplog):
    def broken(**kwargs):
        raise RuntimeError("broker unreachable")

    monkeypatch.setattr(registration, "run_create", broken)
    with caplog.at_level(logging.WARNING, logger="evals.registration"):
        response = api("operator").post("/api/v1/models/tiny/versions/", {"artifact_uri": str(tiny_llama_dir)},
                                        format="json")
    assert response.status_code == 201, response.content
    assert ModelVersion.objects.filter(model=model, number=1).exists() and not EvalRun.objects.exists()
    assert "not scoring tiny v1 on eval set qa: broker unreachable" in caplog.text
    assert "not scoring tiny v1 on eval set same: broker unreachable" in caplog.text
    assert "Traceback" in caplog.text  # an unexpected error keeps its stack for whoever reads the log


def test_a_model_without_default_sets_starts_nothing(tiny_llama_dir):
    other = registry_services.model_create(name="plain", task="generate", actor=None)
    eval_set_with([{"id": "o", "prompt": "x", "expected": "y"}], name="other")
    register(other, tiny_llama_dir)
    assert not EvalRun.objects.exists()
