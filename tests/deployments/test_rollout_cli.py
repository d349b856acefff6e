"""`inferops rollout` as CI runs it: over real HTTP against a live server, with a token from the env."""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.utils import timezone
from rest_framework.authtoken.models import Token

from deployments.models import Deployment, Rollout
from deployments.rollouts import machine as rollout_machine
from deployments.rollouts import services as rollouts
from deployments.rollouts import watch as rollout_watch
from project import cli, rollout_cli
from registry.models import RegisteredModel
from tests.conftest import free_port
from tests.deployments.conftest import make_version
from tests.deployments.test_rollouts_api import exhaust_budget
from tests.waiting import wait_until


@pytest.fixture
def ci(live_server, transactional_db, monkeypatch):
    """`chat` on v1 (max_num_seqs 8) with v2 and v3 registered; an operator's token in INFEROPS_TOKEN."""
    user = User.objects.create_user("ci-bot")
    user.groups.add(Group.objects.get(name="operator"))
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1, _, _ = (make_version(model, n) for n in (1, 2, 3))
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=1,
                                           engine_args={"max_num_seqs": 8})
    # No worker here: nothing to queue the reconcile pass or an SLO evaluation for.
    monkeypatch.setattr(rollouts, "request_reconcile", lambda deployment: None)
    monkeypatch.setattr("slo.services._evaluate_soon", lambda slo_id: None)
    monkeypatch.setenv("INFEROPS_URL", live_server.url)
    monkeypatch.setenv("INFEROPS_TOKEN", Token.objects.create(user=user).key)
    return deployment


def rollout(*options: str) -> int:
    return cli.main(["rollout", "--deployment", "chat", *options])


def in_thread(action, delay: float = 1.5) -> threading.Thread:
    """Run `action(rollout)` on the active rollout `delay` after it appears, as an operator or the
    reconcile pass would (the CLI polls every 0.1 s meanwhile, even on a loaded machine)."""

    def run():
        try:
            active = wait_until(lambda: Rollout.objects.filter(status__in=("progressing", "paused")).first(),
                                "the CLI to create the rollout", 30)
            time.sleep(delay)
            action(active)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_creates_a_rollout_and_reports_refusals(ci, capsys, monkeypatch):
    code = rollout("--version", "2", "--engine-arg", "max_num_seqs=16", "--engine-arg", "no_prefix_caching=true",
                   "--steps", '[{"set_weight": 50}, {"analysis": "1m"}]')
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "created: v1 → v2 (canary, 2 steps)" in out and "step 1/2 (set_weight 50%), weight 0%" in out
    created = Rollout.objects.get()
    assert created.candidate_engine_args == {"max_num_seqs": 16, "no_prefix_caching": True}
    assert created.created_by.username == "ci-bot"

    assert rollout("--version", "3") == 2
    assert f"refused (HTTP 409): Rollout {created.pk} of 'chat' is progressing" in capsys.readouterr().err

    rollouts.rollout_abort(rollout=created, actor=None)
    exhaust_budget(ci)
    assert rollout("--version", "2") == 2
    err = capsys.readouterr().err
    assert "Error budget exhausted for SLO 'chat-availability'" in err and "override_reason" in err

    assert rollout("--version", "2", "--steps", "[{set_weight: 5}]") == 2
    assert "--steps is not valid JSON" in capsys.readouterr().err
    assert rollout("--version", "2", "--strategy", "blue-green", "--scale-down-delay", "soon") == 2
    assert "): scale_down_delay: expected a duration" in capsys.readouterr().err
    assert cli.main(["rollout", "--deployment", "nope", "--version", "2"]) == 2
    assert "HTTP 404" in capsys.readouterr().err
    assert Rollout.objects.count() == 1

    monkeypatch.setenv("INFEROPS_TOKEN", "not-a-token")
    assert rollout("--version", "2") == 2
    assert "HTTP 401" in (err := capsys.readouterr().err) and "Check INFEROPS_TOKEN" in err
    monkeypatch.setenv("INFEROPS_URL", f"http://127.0.0.1:{free_port()}")
    assert rollout("--version", "2") == 3
    assert "cannot reach inferops" in (err := capsys.readouterr().err) and "Check INFEROPS_URL" in err


def test_wait_follows_the_rollout_to_its_outcome(ci, capsys):
    wait = ("--wait", "--poll-interval", "0.1")
    aborter = in_thread(lambda r: rollouts.rollout_abort(rollout=r, actor=None, reason="too slow"))
    code = rollout("--version", "2", "--steps", '[{"pause": {}}]', *wait)
    aborter.join()
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "paused, step 1/1 (pause until promoted), weight 0%: Paused until an operator promotes." in out
    assert "aborted, step 1/1" in out
    assert "aborted, traffic back on v1: aborted by system: too slow" in err

    def finish(r):
        rollouts.rollout_promote(rollout=r, actor=None, full=True)
        rollout_machine.advance(Deployment.objects.get(name="chat"), rollout_machine.CandidateState(ready=1),
                                timezone.now())

    finisher = in_thread(finish)
    code = rollout("--version", "2", "--steps", '[{"set_weight": 20}]', "--no-wait-watch", *wait)
    finisher.join()
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "succeeded: v2 serves all traffic on chat; the platform watches it until" in out

    assert rollout("--version", "3", *wait, "--timeout", "0.3") == 3
    assert "timed out after 0.3s waiting for rollout" in capsys.readouterr().err


def finish(active: Rollout) -> Rollout:
    rollouts.rollout_promote(rollout=active, actor=None, full=True)
    rollout_machine.advance(Deployment.objects.get(name="chat"), rollout_machine.CandidateState(ready=1),
                            timezone.now())
    return Rollout.objects.get(pk=active.pk)


def test_wait_follows_the_watch_after_success_and_fails_when_the_platform_rolls_back(ci, capsys, monkeypatch):
    wait = ("--wait", "--poll-interval", "0.1")
    finisher = in_thread(finish)
    code = rollout("--version", "2", "--watch", "2s", *wait)
    finisher.join()
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "succeeded, watching v2 until" in out and "v2 serves all traffic on chat and passed its watch." in out
    assert Rollout.objects.get(candidate_version__number=2).watch_s == 2

    described: list[dict] = []  # what the CLI has polled and printed, in order
    describe = rollout_cli.describe
    monkeypatch.setattr(rollout_cli, "describe", lambda rollout: described.append(rollout) or describe(rollout))

    def finish_then_roll_back(active):
        done = finish(active)
        # The CLI sees the watch first.
        wait_until(lambda: any(r["id"] == done.pk and r.get("watching") for r in described),
                   "the CLI to see the watch", 30)
        rollout_watch.roll_back(done, done.deployment, timezone.now(), "chat-ttft burn rate: new 20.0, limit 2.0")

    roller = in_thread(finish_then_roll_back)
    code = rollout("--version", "3", *wait)
    roller.join()
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "succeeded, watching v3 until" in out
    rolled = Rollout.objects.get(candidate_version__number=3)
    assert (f"rollout {rolled.pk}: Rolled back by the platform during its watch: chat-ttft burn rate: new 20.0, "
            f"limit 2.0. Rollout {rolled.rolled_back_by_id} puts v2 back on chat.") in err

    rollouts.rollout_abort(rollout=rolled.rolled_back_by, actor=None)
    finisher = in_thread(finish)
    assert rollout("--version", "2", "--no-auto-rollback", *wait) == 0  # nothing to wait for after success
    finisher.join()
    assert "v2 serves all traffic on chat." in capsys.readouterr().out
    assert Rollout.objects.filter(candidate_version__number=2).latest("id").auto_rollback is False
