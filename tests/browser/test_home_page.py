"""The home page in a real Chromium, as an SRE opens it first: what is firing, who is on call,
every deployment's health (with how fresh each figure is, its rollout in progress and its SLO
state), every SLO's budget and burn, and this month's cost; each links to its page."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from alerts.models import Alert
from alerts.schedules import schedule_save
from deployments import rollouts
from slo.evaluation import evaluate_slos
from slo.services import slo_create
from tests.browser.conftest import log_in
from tests.deployments.conftest import make_version
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def platform(settings):
    """chat: a canary in progress, traffic of the last minute half of it too slow for its TTFT SLO
    (evaluation opens a page alert); quiet: no traffic; a weekly on-call schedule."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("sre", password="pw-sre-123456").groups.add(Group.objects.get(name="operator"))
    User.objects.create_user("alice")
    chat = make_deployment("chat")
    make_version(chat.model, 2)
    make_deployment("quiet")
    # Started before the SLO exists: a spent budget would refuse it.
    rollout = rollouts.rollout_create(deployment=chat, actor=None, version=2)
    slo = slo_create(actor=None, name="chat-ttft", deployment=chat, sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", min_requests=10)
    now = timezone.now()
    insert_events([event(now - timedelta(seconds=5), ttft_ms=100.0) for _ in range(20)]
                  + [event(now - timedelta(seconds=5), ttft_ms=400.0) for _ in range(20)]
                  + [event(now - timedelta(seconds=5), status=503, error_kind="upstream_error", ttft_ms=None)])
    evaluate_slos(now=now)
    weekly = {"name": "weekly", "rotation": "weekly", "starts_at": now - timedelta(days=1), "ends_at": None,
              "users": ["alice"]}
    schedule = schedule_save(instance=None, fields={"name": "primary", "time_zone": "UTC", "description": ""},
                             layers=[weekly], actor=None)
    return {"rollout": rollout, "slo": slo, "alert": Alert.objects.get(slo=slo, severity="page"),
            "schedule": schedule}


def test_the_home_page_shows_each_part_and_links_to_its_page(live_server, page, platform, tmp_path):
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    log_in(page, live_server.url, "sre", "pw-sre-123456")  # lands on /
    home = f"{live_server.url}/"

    # Firing first, newest first, each linking to its alert page.
    alert = platform["alert"]
    firing = page.locator("#firing-panel")
    expect(firing.locator(f"tr[data-alert='{alert.pk}']")).to_be_visible()
    shown = [int(pk) for pk in firing.locator("tr[data-alert]").evaluate_all("rows => rows.map(r => r.dataset.alert)")]
    assert shown == sorted(Alert.objects.filter(status="firing").values_list("pk", flat=True), reverse=True)
    expect(page.locator("#on-call-primary .now")).to_have_text("alice")

    chat = page.locator("#deployments-panel tr[data-name=chat]")
    expect(chat.locator(".error-rate .value")).to_have_text("2.44 %")  # 1 of 41 requests
    expect(chat.locator(".error-rate .freshness")).to_contain_text("s ago")
    expect(chat.locator(".ttft-p95 .value")).to_contain_text("ms")
    expect(chat.locator(".slo-state")).to_contain_text("chat-ttft: exhausted")
    expect(chat.locator(".rollout")).to_contain_text("canary")
    quiet = page.locator("#deployments-panel tr[data-name=quiet]")
    expect(quiet.locator(".error-rate .freshness")).to_have_text("no traffic in 5 min")

    slo_row = page.locator("#slo-panel tr[data-name=chat-ttft]")
    expect(slo_row).to_have_attribute("data-state", "exhausted")
    assert slo_row.locator(".burn-1h").inner_text().endswith("×")
    assert page.locator("#home-month-cost").inner_text().startswith("$")
    # Panels in the order an SRE reads them: what burns first.
    order = page.eval_on_selector_all("#home-panels > section", "sections => sections.map(s => s.id)")
    assert order == ["firing-panel", "on-call-panel", "deployments-panel", "slo-panel", "cost-panel"]

    page.screenshot(path=str(tmp_path / "home.png"), full_page=True)

    # Locators resolve again on each visit, so one list serves every round trip.
    links = [
        (firing.locator(f"tr[data-alert='{alert.pk}'] a.alert-link"), f"/alerts/{alert.pk}/"),
        (page.locator("#on-call-panel").get_by_role("link", name="primary"), "/alerts/schedules/primary/"),
        (chat.get_by_role("link", name="chat", exact=True), "/deployments/chat/"),
        (chat.locator(".rollout a"), f"/deployments/chat/rollouts/{platform['rollout'].pk}/"),
        (chat.locator(".slo-state a"), f"/slos/{platform['slo'].pk}/"),
        (slo_row.get_by_role("link", name="chat-ttft"), f"/slos/{platform['slo'].pk}/"),
        (page.locator("#cost-panel").get_by_role("link", name="Cost report"), "/costs/?month="),
    ]
    for link, path in links:
        page.goto(home)
        with page.expect_navigation() as navigation:
            link.click()
        assert navigation.value.status == 200, path
        assert page.url.startswith(f"{live_server.url}{path}"), (page.url, path)
    assert errors == []
