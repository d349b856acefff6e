"""A rollout in a real Chromium: from the deployment's history to its page, the charts of stable vs
candidate drawn from seeded usage events, the analysis table, and an operator's abort."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from deployments.choices import RolloutStatus
from deployments.models import Deployment, Replica, Rollout, RolloutMeasurement
from deployments.rollouts import services as rollouts
from deployments.rollouts.watch import roll_back
from inferops.models import AuditEvent
from registry.models import RegisteredModel
from tenants.models import UsageEvent
from tests.browser.conftest import log_in
from tests.deployments.conftest import make_version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def running_rollout(monkeypatch, settings):
    """A canary at 20% in its analysis step, with a minute of traffic on both tracks and one measurement.

    No replica runs: the rows stand for them, and the reconcile each action requests is not queued.
    """
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    monkeypatch.setattr(rollouts, "request_reconcile", lambda deployment: None)
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1, v2 = make_version(model, 1), make_version(model, 2)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=2)
    rollout = rollouts.rollout_create(deployment=deployment, actor=user, version=2, steps=[
        {"set_weight": 20}, {"analysis": {"duration": "5m", "thresholds": {"ttft_p95_ratio": 1.2}}}])
    now = timezone.now()
    start = now - timedelta(seconds=90)
    stable = Replica.objects.create(deployment=deployment, version=v1, node="n", state="ready")
    candidate = Replica.objects.create(deployment=deployment, version=v2, node="n", state="ready", rollout=rollout)
    events = []
    for second in range(0, 80, 2):
        at = start + timedelta(seconds=second)
        events.append(UsageEvent(request_id=f"s{second}", time=at, deployment="chat", version=1, replica=stable.pk,
                                 endpoint="chat", ttft_ms=100.0 + second, tpot_ms=10.0, e2e_ms=400.0, status=200))
        if second >= 30:
            failed = second % 10 == 0
            events.append(UsageEvent(
                request_id=f"c{second}", time=at, deployment="chat", version=2, replica=candidate.pk,
                endpoint="chat", ttft_ms=None if failed else 180.0 + second, tpot_ms=None if failed else 14.0,
                e2e_ms=500.0, status=502 if failed else 200, error_kind="upstream_error" if failed else None))
    UsageEvent.objects.bulk_create(events)
    weight_at = start + timedelta(seconds=30)
    timeline = [{**rollout.timeline[0], "at": start.isoformat()},  # "created", moved back with created_at
                {"at": weight_at.isoformat(), "event": "weight", "detail": "20% on the candidate"}]
    Rollout.objects.filter(pk=rollout.pk).update(
        created_at=start, step_index=1, weight=20, step_started_at=weight_at, timeline=timeline,
        message="Analysing: 25 candidate requests in 60s; every check within its limit.")
    RolloutMeasurement.objects.create(
        rollout=rollout, step_index=1, taken_at=now - timedelta(seconds=5), window_start=weight_at,
        window_end=now - timedelta(seconds=5), verdict="running", candidate={"requests": 25}, stable={"requests": 40},
        checks=[{"name": "ttft p95 ≤ 1.2× stable", "candidate": 235.0, "stable": 176.0, "limit": 211.2, "ok": False}],
        reason="25 candidate requests in 55s; judging needs 20.",
    )
    return rollout


def test_operator_reads_a_rollout_and_aborts_it(live_server, page, page_errors, running_rollout, tmp_path):
    rollout = running_rollout
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    assert "v1 → v2" in page.locator(f"#rollouts tr[data-id='{rollout.pk}']").inner_text()
    assert "20% of traffic on the candidate" in page.locator("#active-rollout").inner_text()
    page.click("#active-rollout >> text=Rollout")
    page.wait_for_url(f"{live_server.url}/deployments/chat/rollouts/{rollout.pk}/")
    # A reason typed in stops the page's 5-second refresh, so nothing reloads under the test.
    page.fill("#abort-reason", "candidate TTFT too high")

    charts = ["chart-ttft", "chart-tpot", "chart-errors", "chart-requests"]
    page.wait_for_function(
        f"() => {charts}.every(id => document.querySelector('#' + id + ' svg.main-svg') && "
        "document.getElementById(id).dataset.points > 0)", timeout=20000)
    assert sorted(page.locator("#chart-ttft .legendtext").all_text_contents()) == ["candidate", "stable"]
    assert "weight" in page.locator("#chart-ttft").inner_text()  # the timeline's marker
    assert page.locator("#steps li.current").inner_text().startswith("analysis 5m")
    assert "20% candidate · 80% stable" in page.locator("#weight").inner_text()
    row = page.locator("#measurements tbody tr").first
    assert row.get_attribute("data-verdict") == "running"
    assert "ttft p95 ≤ 1.2× stable: 235 vs 176 (limit 211)" in row.inner_text()
    page.screenshot(path=str(tmp_path / "rollout.png"), full_page=True)

    dialogs = []
    page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    page.click("#abort")
    page.wait_for_selector(".messages")
    assert "Traffic returns to v1" in dialogs[0]
    assert "aborted" in page.locator(".messages").inner_text()
    assert page.locator("#status").inner_text() == "aborted"
    assert "0% candidate · 100% stable" in page.locator("#weight").inner_text()
    assert "candidate TTFT too high" in page.locator("#message").inner_text()
    assert page.locator("#retry").count() == 1 and page.locator("#abort").count() == 0
    assert "traffic on stable" in page.locator("#timeline").inner_text()
    rollout.refresh_from_db()
    assert rollout.status == RolloutStatus.ABORTED and rollout.weight == 0
    assert page_errors == []


def test_a_promote_reason_is_recorded_and_each_action_has_its_own_reason_box(live_server, page, running_rollout):
    rollout = running_rollout
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/chat/rollouts/{rollout.pk}/")
    # The abort reason sits in Abort's form, labelled for it; Promote has a box of its own.
    abort = page.locator("#abort-form")
    assert abort.locator("#abort-reason").count() == 1 and abort.locator("#abort").count() == 1
    assert "Reason for aborting" in abort.locator("label[for=abort-reason]").inner_text()
    promote = page.locator("#promote-form")
    assert promote.locator("#abort-reason").count() == 0 and promote.locator("#promote").count() == 1
    assert "Reason for promoting" in promote.locator("label[for=promote-reason]").inner_text()

    page.fill("#abort-reason", "typed for an abort, never sent with a promote")
    page.fill("#promote-reason", "TTFT within 5% on the dashboards")
    page.click("#promote")
    page.wait_for_selector(".messages")
    assert "promoted to its next step" in page.locator(".messages").inner_text()
    promoted = page.locator("#timeline tr", has_text="promoted").inner_text()
    assert "by ops: TTFT within 5% on the dashboards" in promoted
    assert "never sent" not in page.locator("#timeline").inner_text()
    event = AuditEvent.objects.get(action="rollout.promote")
    assert event.after["reason"] == "TTFT within 5% on the dashboards"


def test_a_rolled_back_rollout_reads_rolled_back_with_traffic_back_on_stable(live_server, page, running_rollout):
    rollout = running_rollout
    now = timezone.now()
    # The canary succeeded (v2 serves everything), then the platform rolled it back during its watch.
    Rollout.objects.filter(pk=rollout.pk).update(status=RolloutStatus.SUCCEEDED, weight=100, finished_at=now,
                                                 step_index=2, watch_until=now + timedelta(minutes=10))
    Deployment.objects.filter(pk=rollout.deployment_id).update(version=rollout.candidate_version)
    rollout.refresh_from_db()
    roll_back(rollout, Deployment.objects.get(pk=rollout.deployment_id), now, "TTFT p95 burned the budget")
    rollout.refresh_from_db()
    assert rollout.status == RolloutStatus.ROLLED_BACK and rollout.weight == 100  # the weight it ended at

    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/chat/rollouts/{rollout.pk}/")
    status = page.locator("#status")
    assert status.inner_text() == "rolled back" and status.get_attribute("data-status") == "rolled_back"
    weight = page.locator("#weight")
    assert weight.get_attribute("data-candidate") == "0"
    assert "0% candidate · 100% stable (back on v1)" in weight.inner_text()
    assert page.locator("#weight .candidate").evaluate("el => el.getBoundingClientRect().width") == 0

    page.goto(f"{live_server.url}/deployments/chat/")
    row = page.locator(f"#rollouts tr[data-id='{rollout.pk}'] .state")
    assert row.inner_text() == "rolled back" and row.get_attribute("data-status") == "rolled_back"
    assert "rolled_back" not in page.locator("#rollouts").inner_text()
