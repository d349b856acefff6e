"""The autoscaling panel in a real Chromium: an operator saves a policy from the deployment page (a refused
one first), and the replica chart draws the decisions, each with its reason on hover."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from playwright.sync_api import expect

from capacity.models import ScalingDecision
from deployments.models import Deployment
from tests.browser.conftest import log_in
from tests.slo.conftest import make_deployment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_operator_edits_the_policy_and_reads_the_decisions_on_the_chart(live_server, page, page_errors, settings,
                                                                       monkeypatch):
    from capacity import scaling

    monkeypatch.setattr(scaling, "request_reconcile", lambda deployment: None)  # no worker here
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    deployment = make_deployment()
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2, max_replicas=2, autoscale=True)
    deployment.refresh_from_db()
    scaling.record_decision(deployment, 1, "down", "for 300 s: waiting_per_replica 0 vs target 2 → 0", {})
    scaling.record_decision(deployment, 0, "park", "idle for 900 s: parked until the next request", {})

    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    rows = page.locator("#autoscaling-decisions tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("park 1 → 0")
    page.wait_for_function("() => document.querySelectorAll('#autoscaling-chart .scatterlayer .trace').length == 2")
    # The decisions' trace holds one point per decision, its hover text the kind and the reason.
    texts = page.evaluate("() => document.getElementById('autoscaling-chart').data[1].text")
    assert texts == ["Scale down: for 300 s: waiting_per_replica 0 vs target 2 → 0",
                     "Park (scale to zero): idle for 900 s: parked until the next request"]

    page.click("#autoscaling-policy summary")
    page.fill("#id_autoscaling-min_replicas", "3")
    page.fill("#id_autoscaling-max_replicas", "2")
    page.click("#autoscaling-save")
    expect(page.locator("#autoscaling-form .error").first).to_contain_text("exceeds max_replicas")
    page.fill("#id_autoscaling-min_replicas", "0")
    page.fill("#id_autoscaling-signal_kv_usage", "0.7")
    page.fill("#id_autoscaling-park_after_s", "600")
    page.click("#autoscaling-save")
    expect(page.locator("#autoscaling-signals")).to_contain_text("kv_usage 0.7")
    expect(page.locator("#autoscaling-park")).to_contain_text("parks after 600")
    deployment.refresh_from_db()
    assert (deployment.min_replicas, deployment.autoscaling["park_after_s"]) == (0, 600)
    assert ScalingDecision.objects.filter(deployment=deployment).count() == 2
    assert page_errors == []
