"""Rollout console pages through Django's test client: what viewers and operators see, the actions
and their refusals shown as messages, and the stable-vs-candidate series the charts draw.

Reconciles are requested with transaction.on_commit; these tests run inside a transaction that
never commits, so none is queued and no replica is started.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from deployments.choices import RolloutStatus
from deployments.models import Deployment, Replica, Rollout, RolloutMeasurement
from deployments.rollouts import services as rollouts
from deployments.rollouts import watch as rollout_watch
from deployments.rollouts.series import bucket_seconds, rollout_series
from registry.models import RegisteredModel
from slo.models import Slo, SloStatus
from tenants.models import UsageEvent
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db

_ids = itertools.count()


@pytest.fixture
def deployment() -> Deployment:
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1 = make_version(model, 1)
    make_version(model, 2)
    return Deployment.objects.create(name="chat", model=model, version=v1, replicas=2, engine_args={"max_num_seqs": 8})


def user(role: str) -> User:
    account = User.objects.create_user(f"{role}-console", password="pw-12345678")
    account.groups.add(Group.objects.get(name=role))
    return account


@pytest.fixture
def operator(client):
    account = user("operator")
    client.force_login(account)
    return account


@pytest.fixture
def viewer(client):
    account = user("viewer")
    client.force_login(account)
    return account


def start(deployment, **kwargs) -> Rollout:
    return rollouts.rollout_create(deployment=deployment, actor=None, **{"version": 2, **kwargs})


def flashed(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def url(rollout: Rollout, action: str = "") -> str:
    return f"/deployments/{rollout.deployment.name}/rollouts/{rollout.pk}/" + (f"{action}/" if action else "")


def test_viewer_sees_history_steps_measurements_but_no_buttons(client, viewer, deployment):
    rollout = start(deployment, steps=[{"set_weight": 20}, {"pause": {}},
                                       {"analysis": {"duration": "2m", "min_requests": 5,
                                                     "thresholds": {"ttft_p95_ratio": 1.2}}}])
    RolloutMeasurement.objects.create(
        rollout=rollout, step_index=2, taken_at=timezone.now(), window_start=timezone.now(),
        window_end=timezone.now(), verdict="fail", candidate={"requests": 40, "failed_attempts": 2},
        stable={"requests": 90}, reason="ttft p95 ≤ 1.2× stable: candidate 300.0, stable 100.0, limit 120.0",
        checks=[{"name": "ttft p95 ≤ 1.2× stable", "candidate": 300.0, "stable": 100.0, "limit": 120.0, "ok": False},
                {"name": "chat-availability burn rate", "candidate": 0.5, "stable": 0.25, "limit": 2.0, "ok": True}],
    )

    page = client.get("/deployments/chat/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="rollouts"' in html and f'data-id="{rollout.pk}"' in html and "v1 → v2" in html
    assert 'id="active-rollout"' in html and "step 1 of 3" in html
    assert 'id="start-rollout"' not in html and 'id="undo"' not in html

    page = client.get(url(rollout))
    assert page.status_code == 200
    html = page.content.decode()
    assert [s["text"] for s in page.context["steps"]] == [
        "set weight 20%", "pause until promoted",
        "analysis 2m (min 5 requests, burn rate ≤ 2×, TTFT p95 ≤ 1.2× stable)"]
    assert [s["state"] for s in page.context["steps"]] == ["current", "", ""]
    # Engine arguments read as key/values, not a Python dict (stable's; the candidate's are the same).
    assert 'class="current"' in html and html.count('<span class="k">max_num_seqs</span> 8') == 2
    assert "{&#x27;max_num_seqs" not in html
    row = page.context["measurements"][0]
    assert (row["step"], row["candidate_requests"], row["stable_requests"]) == (3, 42, 90)
    assert "ttft p95 ≤ 1.2× stable: 300 vs 100 (limit 120)" in html and "check-fail" in html and "check-ok" in html
    assert "verdict-fail" in html and "created" in html  # timeline
    assert 'id="promote"' not in html and 'id="abort"' not in html and 'id="retry"' not in html
    assert "window.location.reload" in html  # active: the page refreshes itself
    assert 'id="chart-ttft"' in html and 'id="rollout-data"' in html


def test_viewers_cannot_act(client, viewer, deployment):
    rollout = start(deployment)
    for action in ("promote", "promote-full", "abort", "retry"):
        assert client.post(url(rollout, action)).status_code == 403
    assert client.get(url(rollout, "abort")).status_code == 405
    assert client.post("/deployments/chat/rollouts/new/", {"rollout-version": "2"}).status_code == 403
    assert client.post("/deployments/chat/rollouts/undo/").status_code == 403
    rollout.refresh_from_db()
    assert (rollout.status, rollout.step_index) == (RolloutStatus.PROGRESSING, 0)
    assert Rollout.objects.count() == 1


def test_operator_promotes_aborts_and_retries(client, operator, deployment):
    rollout = start(deployment, steps=[{"pause": {}}, {"set_weight": 10}, {"analysis": "1m"}])
    html = client.get(url(rollout)).content.decode()
    assert all(f'id="{button}"' in html for button in ("promote", "promote-full", "abort"))
    assert 'id="retry"' not in html

    response = client.post(url(rollout, "promote"), follow=True)
    assert response.redirect_chain[-1][0] == url(rollout)
    assert "promoted to its next step" in flashed(response)[0]
    rollout.refresh_from_db()
    assert rollout.step_index == 1
    response = client.post(url(rollout, "promote"), follow=True)  # a weight is never skipped
    assert "moves on by itself once it is ready" in flashed(response)[0]

    response = client.post(url(rollout, "promote-full"), {"reason": "x" * 501}, follow=True)
    assert "too long" in flashed(response)[0]
    response = client.post(url(rollout, "promote-full"), {"reason": "eval set green"}, follow=True)
    assert "promoted through every step" in flashed(response)[0]
    assert "promoted</td><td>by operator-console (full): eval set green" in response.content.decode()
    assert "the candidate takes all traffic at full size <span class=\"muted\">← now" in response.content.decode()
    rollout.refresh_from_db()
    assert rollout.step_index == len(rollout.steps) and rollout.active

    response = client.post(url(rollout, "abort"), {"reason": "latency looks off"}, follow=True)
    rollout.refresh_from_db()
    assert rollout.status == RolloutStatus.ABORTED and rollout.weight == 0
    assert "aborted by operator-console: latency looks off" in rollout.message
    assert "traffic is back on the stable version" in flashed(response)[0]
    html = response.content.decode()
    assert 'id="retry"' in html and 'id="abort"' not in html and "window.location.reload" not in html
    assert 'class="stopped"' not in html  # aborted in the final phase: no step to mark

    client.post(url(rollout, "retry"))
    rollout.refresh_from_db()
    assert (rollout.status, rollout.step_index, rollout.attempt) == (RolloutStatus.PAUSED, 0, 2)  # the pause again


def test_refusals_are_messages_not_errors(client, operator, deployment):
    rollout = start(deployment)
    client.post(url(rollout, "abort"), follow=True)
    response = client.post(url(rollout, "promote"), follow=True)
    assert response.status_code == 200
    assert flashed(response) == [f"Rollout {rollout.pk} is aborted; only a running or paused rollout is promoted."]
    assert f"Rollout {rollout.pk} is aborted" in response.content.decode()

    response = client.post(url(rollout, "abort"), {"reason": "x" * 501}, follow=True)
    assert "too long" in flashed(response)[0]

    # Retry while the budget is spent: 409 naming the SLO; with an override it goes ahead, audited.
    slo = Slo.objects.create(name="chat-availability", deployment=deployment, sli_kind="availability", objective=0.99)
    SloStatus.objects.create(slo=slo, budget_remaining=-0.25, state="exhausted", evaluated_at=timezone.now())
    response = client.post(url(rollout, "retry"), follow=True)
    assert "Error budget exhausted for SLO 'chat-availability'" in flashed(response)[0]
    assert Rollout.objects.get().status == RolloutStatus.ABORTED
    client.post(url(rollout, "retry"), {"override_reason": "game day"})
    rollout.refresh_from_db()
    assert rollout.active and rollout.override_reason == "game day"


def test_start_rollout_form(client, operator, deployment):
    html = client.get("/deployments/chat/").content.decode()
    assert 'id="start-rollout"' in html and "set_weight" in html  # the default steps prefilled
    form = client.get("/deployments/chat/").context["rollout_form"]
    assert [label for _, label in form.fields["version"].choices] == ["v1 (keep the current version)", "v2", "v1"]

    def post(**fields):
        data = {"rollout-strategy": "canary", "rollout-engine_args": "", "rollout-steps": "", **{
            f"rollout-{name}": value for name, value in fields.items()}}
        return client.post("/deployments/chat/rollouts/new/", data)

    for fields, fragment in [
        ({"version": "2", "steps": "[{oops"}, "Not valid JSON"),
        ({"version": "2", "steps": '[{"set_weight": 120}]'}, "steps[0].set_weight: expected an integer percent"),
        ({"version": "2", "steps": '{"set_weight": 10}'}, "Expected a list of steps"),
        ({"version": "2", "engine_args": '{"max_num_seqs": "many"}'}, "max_num_seqs"),
        ({"version": "", "engine_args": ""}, "Give the candidate"),
        ({"version": "1", "engine_args": '{"max_num_seqs": 8}'}, "nothing to roll out"),
        ({"version": "7"}, "Select a valid choice"),
        ({"version": "2", "strategy": "blue-green", "scale_down_delay": "soon"}, "scale_down_delay: expected"),
    ]:
        response = post(**fields)
        assert response.status_code == 400, fields
        assert fragment in response.content.decode(), (fields, response.context["rollout_form"].errors)
    assert not Rollout.objects.exists()

    response = post(version="", engine_args='{"max_num_seqs": 16}', steps='[{"set_weight": 50}]')
    rollout = Rollout.objects.get()
    assert response.status_code == 302 and response["Location"] == url(rollout)
    assert (rollout.candidate_version.number, rollout.candidate_engine_args) == (1, {"max_num_seqs": 16})
    assert rollout.steps == [{"set_weight": 50}]

    response = post(version="2")  # another one runs: 409 on the form
    assert response.status_code == 400
    assert f"Rollout {rollout.pk} of &#x27;chat&#x27; is progressing" in response.content.decode()

    client.post(url(rollout, "abort"), follow=True)
    slo = Slo.objects.create(name="chat-availability", deployment=deployment, sli_kind="availability", objective=0.99)
    SloStatus.objects.create(slo=slo, budget_remaining=0.0, state="exhausted", evaluated_at=timezone.now())
    response = post(version="2", strategy="blue-green", scale_down_delay="10m", steps='[{"set_weight": 5}]')
    assert response.status_code == 400 and "Error budget exhausted for SLO" in response.content.decode()
    response = post(version="2", strategy="blue-green", scale_down_delay="10m", override_reason="hotfix")
    blue_green = Rollout.objects.order_by("-id").first()
    assert response.status_code == 302 and blue_green.strategy == "blue-green"
    assert (blue_green.scale_down_delay_s, blue_green.steps, blue_green.override_reason) == (
        600.0, [{"set_weight": 100}], "hotfix")  # the canary steps are not a blue-green's


def test_undo_aborts_or_rolls_back(client, operator, deployment):
    assert 'id="undo"' not in client.get("/deployments/chat/").content.decode()
    response = client.post("/deployments/chat/rollouts/undo/", follow=True)
    assert "Nothing to undo" in flashed(response)[0]

    rollout = start(deployment)
    assert "Undo: abort rollout" in client.get("/deployments/chat/").content.decode()
    response = client.post("/deployments/chat/rollouts/undo/")
    assert response["Location"] == url(rollout)
    rollout.refresh_from_db()
    assert rollout.status == RolloutStatus.ABORTED and "undo" in rollout.message

    # As if the reconcile pass had finished a second rollout: v2 serves, so undo goes back to v1.
    done = start(deployment)
    Rollout.objects.filter(pk=done.pk).update(status=RolloutStatus.SUCCEEDED, finished_at=timezone.now(), weight=100)
    Deployment.objects.filter(pk=deployment.pk).update(version=done.candidate_version)
    assert "Undo: roll back to v1" in client.get("/deployments/chat/").content.decode()
    client.post("/deployments/chat/rollouts/undo/")
    rollback = Rollout.objects.order_by("-id").first()
    assert (rollback.rollback, rollback.strategy, rollback.candidate_version.number) == (True, "blue-green", 1)


def test_page_shows_the_watch_and_why_the_platform_rolled_back(client, viewer, deployment):
    rollout = start(deployment, steps=[{"set_weight": 50}], watch="10m")
    assert "600 s once it succeeds, auto-rollback on" in client.get(url(rollout)).content.decode()

    # As if the reconcile pass had finished it: v2 serves and is watched.
    finished = timezone.now()
    until = finished + timedelta(minutes=10)
    Rollout.objects.filter(pk=rollout.pk).update(status=RolloutStatus.SUCCEEDED, finished_at=finished, weight=100,
                                                 step_index=1, watch_until=until)
    Deployment.objects.filter(pk=deployment.pk).update(version=rollout.candidate_version)
    RolloutMeasurement.objects.create(
        rollout=rollout, step_index=1, taken_at=finished, window_start=finished, window_end=finished,
        verdict="running", reason="3 requests on the new version since it took all traffic; judging needs 20.")
    page = client.get(url(rollout)).content.decode()
    assert f"Watching until {timezone.localtime(until):%H:%M}, auto-rollback on" in page
    assert "refreshes every 5 s" in page and '">watch</td>' in page
    assert "95% candidate · 5% stable <span class=\"muted\">(v2 serves all but the holdback)" in page
    Rollout.objects.filter(pk=rollout.pk).update(auto_rollback=False)  # no holdback without the watch's rollback
    assert "100% candidate · 0% stable <span class=\"muted\">(v2 serves)" in client.get(url(rollout)).content.decode()
    Rollout.objects.filter(pk=rollout.pk).update(auto_rollback=True)

    rollback = rollout_watch.roll_back(Rollout.objects.get(pk=rollout.pk), deployment, timezone.now(),
                                       "the new version burns an SLO the previous one did not: chat-ttft")
    page = client.get(url(rollout)).content.decode()
    assert 'id="status" data-status="rolled_back">rolled back<' in page and "refreshes every 5 s" not in page
    assert "Rolled back by the platform during its watch: the new version burns an SLO" in page
    assert f'href="/deployments/chat/rollouts/{rollback.pk}/" id="rolled-back-by">rollout {rollback.pk}</a>' in page
    assert "Watch after success" not in client.get(url(rollback)).content.decode()  # rollbacks are not watched


def test_an_operator_turns_auto_rollback_off_and_on_from_the_page(client, operator, deployment):
    rollout = start(deployment, steps=[{"set_weight": 50}], watch="10m")
    page = client.get(url(rollout)).content.decode()
    assert 'id="auto-rollback">Turn auto-rollback off<' in page
    response = client.post(url(rollout, "auto-rollback/off"))
    assert response.status_code == 302
    assert "will not be rolled back by the platform during its watch" in flashed(client.get(url(rollout)))[0]
    rollout.refresh_from_db()
    assert rollout.auto_rollback is False and rollout.timeline[-1]["event"] == "auto-rollback off"
    client.post(url(rollout, "auto-rollback/on"))
    rollout.refresh_from_db()
    assert rollout.auto_rollback is True
    rollouts.rollout_abort(rollout=rollout, actor=None)
    assert 'id="auto-rollback"' not in client.get(url(rollout)).content.decode()  # nothing left to watch


# ---------------------------------------------------------------------------- the series

T0 = datetime(2026, 3, 10, 12, 0, 0, tzinfo=UTC)


def event(at: float, replica: int | None, *, deployment: str = "chat", failed_replica: int | None = None,
          **fields) -> UsageEvent:
    row = {"request_id": f"req-{next(_ids)}", "time": T0 + timedelta(seconds=at), "deployment": deployment,
           "replica": replica, "failed_replica": failed_replica, "endpoint": "chat", "ttft_ms": 100.0,
           "tpot_ms": 10.0, "e2e_ms": 300.0, "status": 200, **fields}
    return UsageEvent(**row)


def test_series_buckets_by_serving_replica(deployment):
    rollout = start(deployment)
    other = Deployment.objects.create(name="other", model=deployment.model, version=deployment.version)
    stable = Replica.objects.create(deployment=deployment, version=deployment.version, node="n")
    old_candidate = Replica.objects.create(deployment=deployment, version=rollout.candidate_version, node="n")
    candidate = Replica.objects.create(deployment=deployment, version=rollout.candidate_version, node="n",
                                       rollout=rollout)
    foreign = Replica.objects.create(deployment=other, version=deployment.version, node="n")
    UsageEvent.objects.bulk_create([
        # bucket 0 [0, 10): stable only, TTFT 100..1000 -> p95 by linear interpolation
        *[event(1 + i * 0.5, stable.pk, ttft_ms=100.0 * (i + 1)) for i in range(10)],
        # bucket 1 [10, 20): candidate: 3 good, 1 server error (its latency is left out), 1 client error;
        # a stable request retried from a candidate replica counts a failed candidate attempt
        event(11, candidate.pk, ttft_ms=200.0, tpot_ms=20.0),
        event(12, candidate.pk, ttft_ms=400.0, tpot_ms=40.0),
        event(13, candidate.pk, ttft_ms=600.0, tpot_ms=60.0),
        event(14, candidate.pk, ttft_ms=5000.0, status=502, error_kind="upstream_error"),
        event(15, candidate.pk, ttft_ms=None, tpot_ms=None, status=429, error_kind="rate_limited"),
        event(16, stable.pk, failed_replica=candidate.pk, ttft_ms=150.0),
        event(17, old_candidate.pk, ttft_ms=150.0),  # another rollout's replica: stable here
        # bucket 2 [20, 30): nothing. bucket 3 [30, 40): the preview route, a candidate request
        event(35, candidate.pk, deployment="chat--preview", ttft_ms=300.0),
        # not counted: another deployment, no replica, before and after the window
        event(12, foreign.pk, deployment="other"),
        event(12, None, status=401, error_kind="unauthorized"),
        event(-1, stable.pk),
        event(40, candidate.pk),
    ])

    series = rollout_series(rollout, T0, T0 + timedelta(seconds=40), bucket_s=10)
    assert series["time"] == [T0 + timedelta(seconds=s) for s in (0, 10, 20, 30)]
    assert series["stable"]["requests"] == [10, 2, 0, 0]
    assert series["stable"]["errors"] == [0, 0, 0, 0]
    assert series["stable"]["error_rate"] == [0.0, 0.0, None, None]
    assert series["stable"]["ttft_p95_ms"] == [955.0, 150.0, None, None]
    assert series["candidate"]["requests"] == [0, 5, 0, 1]
    assert series["candidate"]["errors"] == [0, 2, 0, 0]  # the 502 and the failed attempt
    assert series["candidate"]["error_rate"] == [None, round(2 / 6, 4), None, 0.0]
    # p95 of 200, 400, 600 (the 429 has no TTFT; the 502 and the failed attempt are left out)
    assert series["candidate"]["ttft_p95_ms"] == [None, 580.0, None, 300.0]
    assert series["candidate"]["tpot_p95_ms"] == [None, 58.0, None, 10.0]

    assert bucket_seconds(T0, T0 + timedelta(minutes=30)) == 10
    assert bucket_seconds(T0, T0 + timedelta(days=1)) == 60  # at most 1440 buckets
    wide = rollout_series(rollout, T0, T0 + timedelta(days=1))
    assert wide["bucket_s"] == 60 and len(wide["time"]) == 1440
    assert wide["candidate"]["requests"][0] == 7 and wide["stable"]["requests"][0] == 12


def test_rollout_page_charts_the_rollout_span(client, viewer, deployment):
    rollout = start(deployment)
    candidate = Replica.objects.create(deployment=deployment, version=rollout.candidate_version, node="n",
                                       rollout=rollout)
    UsageEvent.objects.create(request_id="r1", time=timezone.now() - timedelta(seconds=1), deployment="chat",
                              replica=candidate.pk, ttft_ms=120.0, tpot_ms=12.0, e2e_ms=200.0, status=200,
                              endpoint="chat")
    Rollout.objects.filter(pk=rollout.pk).update(created_at=timezone.now() - timedelta(seconds=30))
    data = client.get(url(rollout)).context["chart_data"]
    assert data["series"]["bucket_s"] == 10 and len(data["series"]["time"]) in (3, 4)
    assert sum(data["series"]["candidate"]["requests"]) == 1
    assert [entry["event"] for entry in data["timeline"]] == ["created"]

    Rollout.objects.filter(pk=rollout.pk).update(created_at=timezone.now() - timedelta(days=2))
    page = client.get(url(rollout))
    assert page.context["chart_clipped"] and page.context["chart_data"]["series"]["bucket_s"] == 20  # 6 h
    assert "the last 6 hours, 20 s buckets" in page.content.decode()
