"""The deployment page in a real Chromium: it follows replicas that change state in the database
without a reload, draws the error-rate chart (shed requests included) with event markers, and
lists the API keys that may call it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, ReplicaMetricsMinute, Rollout
from registry.models import RegisteredModel
from tenants.models import UsageEvent
from tenants.services import key_create, tenant_create
from tests.browser.conftest import log_in
from tests.deployments.conftest import make_version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def scaling_deployment():
    """`chat` scaled to 2: one replica ready, one starting, as the reconciler last wrote it. No replica
    process runs: the test moves the rows as the reconciler would."""
    user = User.objects.create_user("look", password="pw-look-123456")
    user.groups.add(Group.objects.get(name="viewer"))
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1, v2 = make_version(model, 1), make_version(model, 2)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=2, status="progressing",
                                           status_message="1/2 replicas of v1 ready")
    ready = Replica.objects.create(deployment=deployment, version=v1, node="test", url="http://127.0.0.1:9/1",
                                   state=ReplicaState.READY, started_at=timezone.now() - timedelta(minutes=20))
    starting = Replica.objects.create(deployment=deployment, version=v1, node="test", url="http://127.0.0.1:9/2",
                                      state=ReplicaState.STARTING)
    return deployment, (v1, v2), (ready, starting)


def test_page_follows_replicas_without_reload(live_server, page, scaling_deployment):
    deployment, _, (ready, starting) = scaling_deployment
    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    assert page.locator("#ready").inner_text().startswith("1 / 2")
    assert page.locator("#status").inner_text() == "progressing"
    page.evaluate("window.notReloaded = true")

    # The second replica turns ready and the reconciler writes the status.
    Replica.objects.filter(pk=starting.pk).update(state=ReplicaState.READY, started_at=timezone.now())
    Deployment.objects.filter(pk=deployment.pk).update(status="ready", status_message="")
    page.wait_for_function("() => document.querySelector('#ready').textContent === '2 / 2 · up to date'"
                           " && document.querySelector('#status').textContent === 'ready'", timeout=15000)
    assert page.locator("#status-message").is_hidden()
    row = page.locator(f"#replicas tr[data-id='{starting.pk}']").inner_text()
    assert "ready" in row and "http://127.0.0.1:9/2" in row

    # One crashes and restarts: its row says so, with the reason, and the header counts one ready.
    Replica.objects.filter(pk=ready.pk).update(state=ReplicaState.STARTING, restarts=1,
                                               last_error="exited with code 137 (out of memory)")
    Deployment.objects.filter(pk=deployment.pk).update(status="progressing",
                                                       status_message="1/2 replicas of v1 ready")
    page.wait_for_function(f"() => (document.querySelector(\"#replicas tr[data-id='{ready.pk}']\") || {{}}).textContent"
                           "?.includes('exited with code 137')", timeout=15000)
    assert page.locator("#ready").inner_text() == "1 / 2"
    assert page.locator("#status-message").inner_text() == "1/2 replicas of v1 ready"
    assert page.evaluate("window.notReloaded") is True


def test_error_rate_chart_counts_shed_requests_and_marks_events(live_server, page, scaling_deployment, tmp_path):
    deployment, (v1, v2), (ready, _) = scaling_deployment
    now = timezone.now()
    # A short outage: requests shed before any replica was chosen, beside requests a replica served.
    for index in range(6):
        UsageEvent.objects.create(request_id=f"ok-{index}", time=now - timedelta(minutes=3), deployment="chat",
                                  replica=ready.pk, endpoint="chat", e2e_ms=120.0, status=200)
    for index in range(2):
        UsageEvent.objects.create(request_id=f"shed-{index}", time=now - timedelta(minutes=2), deployment="chat",
                                  replica=None, endpoint="chat", e2e_ms=1.0, status=503, error_kind="shed")
    rollout = Rollout.objects.create(
        deployment=deployment, stable_version=v1, candidate_version=v2, step_started_at=now, status="aborted",
        finished_at=now - timedelta(minutes=4), timeline=[
            {"at": (now - timedelta(minutes=5)).isoformat(), "event": "created", "detail": "v1 → v2 (canary)"},
            {"at": (now - timedelta(minutes=4)).isoformat(), "event": "aborted", "detail": "by look"}])
    Rollout.objects.filter(pk=rollout.pk).update(created_at=now - timedelta(minutes=5))
    # One sparse minute of KV-cache use: a single point, in percent.
    ReplicaMetricsMinute.objects.create(replica=ready, deployment=deployment, version=v1, scrapes=4,
                                        start=(now - timedelta(minutes=2)).replace(second=0, microsecond=0),
                                        kv_cache_usage_avg=0.005)

    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    page.wait_for_function("() => document.querySelector('#chart-error_rate').dataset.points > 0"
                           " && document.querySelector('#chart-kv_cache_usage').dataset.points > 0", timeout=20000)
    chart = page.locator("#chart-error_rate")
    assert chart.get_attribute("data-events") == "2"
    # Each minute its own point: the one of successes at 0 %, the one of the outage (all shed) at 100 %.
    values = page.evaluate("document.getElementById('chart-error_rate').data[0].y.filter(v => v !== null)")
    assert sorted(values) == [0, 100]  # the minute of successes, the minute of the outage
    assert page.locator("#chart-error_rate .shapelayer path").count() == 2
    marks = page.evaluate("document.getElementById('chart-error_rate').data.filter(t => t.meta === 'events')"
                          ".flatMap(t => t.text)")
    assert any(f"Rollout {rollout.pk} aborted" in text for text in marks)
    # Every chart carries the markers, the KV chart reads in percent over the whole hour.
    assert page.locator("#chart-kv_cache_usage").get_attribute("data-events") == "2"
    ticks = page.locator("#chart-kv_cache_usage .ytick text").all_text_contents()  # SVG: no inner text
    assert ticks and all(tick.endswith("%") for tick in ticks), ticks
    span_s = page.evaluate("(() => { const r = document.getElementById('chart-kv_cache_usage').layout.xaxis.range;"
                           " return (new Date(r[1]) - new Date(r[0])) / 1000; })()")
    assert span_s >= 3600
    page.screenshot(path=str(tmp_path / "deployment-live.png"), full_page=True)


def test_the_page_lists_the_keys_that_may_call_it(live_server, page, scaling_deployment):
    chat = scaling_deployment[0]
    Deployment.objects.create(name="embed", model=chat.model, version=chat.version)
    acme, beta = tenant_create(name="acme", actor=None), tenant_create(name="beta", actor=None)
    scoped, secret = key_create(tenant=acme, name="ci-pipeline", actor=None, deployments=["chat"])
    key_create(tenant=beta, name="embedder", actor=None, deployments=["embed"])
    key_create(tenant=beta, name="everything", actor=None)

    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    panel = page.locator("#keys-panel")
    rows = panel.locator("#deployment-keys tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-prefix", scoped.prefix)
    expect(rows.first).to_contain_text("ci-pipeline")
    expect(panel.locator("#unscoped-keys")).to_contain_text(
        "1 key with no deployment scope reaches every deployment, this one included: beta (1).")
    assert secret not in page.content()
    with page.expect_navigation():
        rows.first.get_by_role("link", name="acme").click()
    assert page.url == f"{live_server.url}/tenants/acme/#keys"
    expect(page.locator(f"#keys tr[data-prefix='{scoped.prefix}']")).to_be_visible()
