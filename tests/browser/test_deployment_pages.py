"""Deployments in a real Chromium: create with validation, a live replica, charts, scaling."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from deployments.models import Replica, ReplicaMetricsMinute
from deployments.replicas.drivers.local import LocalProcessDriver
from registry import services
from tests.browser.conftest import log_in
from tests.deployments.test_reconcile import all_ready, reconcile_until

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def operator_and_model(tiny_llama_dir, settings, tmp_path):
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.5, "health_timeout_s": 1}
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    model = services.model_create(name="tiny", task="generate", actor=user)
    services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=user)
    services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=user)
    yield user, model
    driver = LocalProcessDriver()
    for replica in Replica.objects.all():
        driver.kill(replica)


def test_operator_creates_watches_and_scales_a_deployment(live_server, page, operator_and_model, tmp_path):
    from deployments.models import Deployment

    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.click("header nav >> text=Deployments")
    assert "No deployments yet" in page.locator("#deployments").inner_text()

    page.click("text=New deployment")
    page.fill("#id_name", "chat")
    page.select_option("#id_version", "tiny:1")
    page.fill("#id_engine_args", '{"max_num_seqs": "lots"}')
    page.click("main form button[type=submit]")
    assert "max_num_seqs" in page.locator(".error").first.inner_text()
    assert not Deployment.objects.exists()
    page.fill("#id_engine_args", '{"max_num_seqs": 8}')
    page.click("main form button[type=submit]")
    page.wait_for_url(f"{live_server.url}/deployments/chat/")

    deployment = Deployment.objects.get(name="chat")
    reconcile_until(deployment, all_ready(1))
    replica = Replica.objects.get(deployment=deployment)
    now = timezone.now().replace(second=0, microsecond=0)
    for minutes_ago in range(1, 6):
        ReplicaMetricsMinute.objects.create(
            replica=replica, deployment=deployment, version=deployment.version,
            start=now - timedelta(minutes=minutes_ago), scrapes=4, waiting_avg=1, kv_cache_usage_avg=0.25,
            generation_tokens=600, requests_by_reason={"stop": 30, "length": 30},
            ttft_buckets={"0.05": 40, "0.1": 55, "0.25": 60, "+Inf": 60}, ttft_sum=3.0, ttft_count=60,
        )
    page.reload()
    row = page.locator("#replicas tbody tr").first.inner_text()
    assert "ready" in row and replica.url in row and "v1" in row
    page.locator("#replicas details summary").first.click()
    log_tail = page.locator("#replicas pre").first.inner_text()
    assert f"127.0.0.1:{replica.port}" in log_tail or "GET /health" in log_tail  # the replica's own log
    page.wait_for_function(
        "() => document.querySelector('#chart-requests_per_s').dataset.points > 0"
        " && document.querySelector('#chart-ttft').dataset.points > 0", timeout=20000)
    assert page.locator("#chart-ttft .legend").text_content().count("ttft_p") == 3
    page.screenshot(path=str(tmp_path / "deployment.png"), full_page=True)

    page.goto(f"{live_server.url}/deployments/")
    row = page.locator("#deployments tr[data-name=chat]")
    assert "ready" in row.inner_text() and "1 / 1" in row.inner_text()
    page.wait_for_function("() => document.querySelector('td[data-series=requests_per_s]').textContent !== '…'")

    page.goto(f"{live_server.url}/deployments/chat/edit/")
    page.fill("#id_replicas", "2")
    page.select_option("#id_version", "tiny:2")
    page.click("main form button[type=submit]")
    diff = page.locator("main").inner_text()  # nothing applies before the diff is confirmed
    assert "Review the change to chat" in diff and "v1" in diff and "v2" in diff
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.version.number) == (1, 1)
    page.click("#confirm")
    page.wait_for_url(f"{live_server.url}/deployments/chat/")
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.version.number) == (2, 2)
    assert "v2" in page.locator(".card").first.inner_text()


def test_viewer_cannot_open_forms(live_server, page, operator_and_model):
    user = User.objects.create_user("look", password="pw-look-123456")
    user.groups.add(Group.objects.get(name="viewer"))
    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}/deployments/")
    assert page.locator("text=New deployment").count() == 0
    assert page.goto(f"{live_server.url}/deployments/new/").status == 403
