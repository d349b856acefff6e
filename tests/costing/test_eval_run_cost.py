"""An eval run's usd, set by costing when evals.signals.run_finished is sent: tokens at the
deployment's list price when it has one, else the replica time the run held at the price book's
hourly prices (a temporary replica's whole life for a version target)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costing import services
from evals.choices import RunStatus, TargetKind
from evals.models import EvalRun
from evals.runs import runner
from evals.runs import services as run_services
from evals.signals import run_finished
from tests.costing.conftest import make_deployment, make_replica, price
from tests.costing.eval_rows import finished_run, set_version
from tests.evals.runs_world import eval_set_with, register_tiny

pytestmark = pytest.mark.django_db


@pytest.fixture
def now():
    return timezone.now().replace(microsecond=0)


@pytest.fixture
def chat(now):
    """Deployment chat (model tiny, versions 1 and 2), one core per replica; cores at $0.36 an hour."""
    price("cpu", "0.36", now - timedelta(days=30))
    return make_deployment("chat", model="tiny", versions=2, resources={"cpu": "1"})


def finish(run: EvalRun) -> EvalRun:
    run_finished.send(sender=EvalRun, run=run)
    run.refresh_from_db()
    return run


def run_on(deployment, now, *, minutes: float = 30, **fields) -> EvalRun:
    """A run of the deployment's version that took `minutes` and ended now: 1,000 prompt and 500 completion tokens."""
    return finished_run(deployment.version, set_version(), 1.0, deployment=deployment, finished_at=now,
                        started_at=now - timedelta(minutes=minutes), prompt_tokens=1000, completion_tokens=500,
                        **fields)


def test_a_deployment_with_a_list_price_pays_its_tokens(chat, now):
    services.list_price_create(deployment="chat", usd_per_mtok_prompt=Decimal(2), usd_per_mtok_completion=Decimal(6),
                               effective_from=now - timedelta(days=1), actor=None)
    # A tenant's own list price is what that tenant pays, not the run.
    services.list_price_create(deployment="chat", tenant="acme", usd_per_mtok_prompt=Decimal(100),
                               usd_per_mtok_completion=Decimal(100), effective_from=now - timedelta(days=1), actor=None)
    make_replica(chat, started_at=now - timedelta(hours=2))  # its time is not the run's: live traffic shares it
    run = finish(run_on(chat, now))
    assert run.usd == Decimal("0.005000")  # 1,000 prompt tokens at $2/MTok + 500 completion at $6/MTok


def test_a_list_price_that_starts_after_the_run_does_not_apply(chat, now):
    services.list_price_create(deployment="chat", usd_per_mtok_prompt=Decimal(2), usd_per_mtok_completion=Decimal(6),
                               effective_from=now - timedelta(minutes=5), actor=None)
    make_replica(chat, started_at=now - timedelta(hours=2))
    assert finish(run_on(chat, now)).usd == Decimal("0.180000")  # half an hour of one $0.36 core


def test_without_a_list_price_the_run_pays_the_replicas_it_held(chat, now):
    make_replica(chat, started_at=now - timedelta(hours=2))  # the whole run: 30 min
    make_replica(chat, started_at=now - timedelta(minutes=20), node="node-b")  # joined 10 min in: 20 min
    make_replica(chat, started_at=now - timedelta(minutes=50), state="stopped",  # left 10 min in: 10 min
                 stopped_at=now - timedelta(minutes=20), node="node-c")
    make_replica(chat, started_at=now - timedelta(hours=3), state="stopped", stopped_at=now - timedelta(hours=1))
    make_replica(chat, version=2, started_at=now - timedelta(hours=2), node="node-d")  # another version
    run = finish(run_on(chat, now))
    assert run.usd == Decimal("0.360000")  # 60 core-minutes at $0.36 an hour


def test_a_version_target_pays_its_temporary_replica_for_the_whole_run(chat, now):
    v2 = chat.model.versions.get(number=2)
    make_replica(chat, version=2, started_at=now - timedelta(hours=2))  # a deployment's: not the run's
    run = finished_run(v2, set_version(), 0.5, finished_at=now, started_at=now - timedelta(minutes=10),
                       engine_args={"cpu_threads": 2})
    assert run.target_kind == TargetKind.VERSION
    assert finish(run).usd == Decimal("0.120000")  # 10 minutes of 2 cores at $0.36 an hour
    # Without cpu_threads the local driver's replica takes every core of the host (4 in this suite).
    run.engine_args = {}
    run.save(update_fields=["engine_args"])
    assert finish(run).usd == Decimal("0.240000")
    # A parity reference no deployment serves ran on a temporary replica of its own too, with the
    # engine's defaults; on an exact set, no reference replica was started.
    run.reference_version = chat.model.versions.get(number=1)
    run.engine_args = {"cpu_threads": 2}
    run.save(update_fields=["reference_version", "engine_args"])
    assert finish(run).usd == Decimal("0.120000")
    run.set_version = eval_set_with([{"id": "p1", "prompt": "hello"}], name="parity", scorer="parity")
    run.save(update_fields=["set_version"])
    assert finish(run).usd == Decimal("0.360000")  # + 10 minutes of the host's 4 cores


def test_unpriced_runs_stay_unpriced_and_a_run_that_never_started_cost_nothing(now):
    deployment = make_deployment("bare", model="bare")
    make_replica(deployment, started_at=now - timedelta(hours=1))
    run = finish(run_on(deployment, now))
    assert run.usd is None  # no price in the book for what the replica holds: not $0
    price("cpu", "0.36", now - timedelta(days=1))
    queued = finished_run(deployment.version, set_version(), 0, status=RunStatus.CANCELLED, deployment=deployment)
    EvalRun.objects.filter(pk=queued.pk).update(started_at=None)
    queued.refresh_from_db()
    assert finish(queued).usd == Decimal(0)
    assert finish(run).usd == Decimal("0.720000")  # 30 minutes of the host's 4 cores at $0.36 an hour


def test_a_failed_run_pays_for_what_it_held(chat, now):
    make_replica(chat, started_at=now - timedelta(hours=2))
    run = finish(run_on(chat, now, minutes=5, status=RunStatus.FAILED))
    assert run.usd == Decimal("0.030000")


@pytest.mark.django_db(transaction=True)  # the runner sends run_finished once its row is committed
def test_a_real_run_on_a_temporary_replica_is_priced_for_its_whole_life(tiny_llama_dir, settings, tmp_path):
    settings.INFEROPS_DATA_DIR = tmp_path
    price("cpu", "0.36", timezone.now() - timedelta(days=1))
    register_tiny(tiny_llama_dir)
    cases = eval_set_with([{"id": "a", "prompt": "one two three", "expected": "never said"}], name="smoke")
    run = run_services.run_create(eval_set=cases.eval_set, actor=None, target={"model": "tiny", "version": 1})
    assert runner.execute_run(run.pk) == RunStatus.SUCCEEDED
    run.refresh_from_db()
    held_s = Decimal(str((run.finished_at - run.started_at).total_seconds()))
    # The host's 4 cores (this suite's INFEROPS_COST_LOCAL_CPUS) at $0.36 an hour, from the claim to the end.
    assert run.usd == (Decimal("0.36") * 4 * held_s / 3600).quantize(Decimal("0.000001")) and run.usd > 0
