"""The home page in a real Chromium, as an SRE opens it first: what is firing, who is on call,
every deployment's health (with how fresh each figure is, its rollout in progress and its SLO
state), every SLO's budget and burn, and this month's cost; each links to its page. The overview
(home and /deployments/) follows the database without a reload, says when it went stale and pauses
while someone types in it; messages read in their level's colour; the icon is served."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from alerts.models import Alert
from alerts.schedules.services import schedule_save
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from deployments.rollouts import services as rollouts
from slo.evaluation import evaluate_slos
from slo.models import Slo, SloStatus
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
    # In this minute: a 1d SLO pages on a 1-minute short window, which holds only the current minute.
    at = max(now - timedelta(seconds=5), now.replace(second=0, microsecond=0))
    insert_events([event(at, ttft_ms=100.0) for _ in range(20)]
                  + [event(at, ttft_ms=400.0) for _ in range(20)]
                  + [event(at, status=503, error_kind="upstream_error", ttft_ms=None)])
    evaluate_slos(now=now)
    weekly = {"name": "weekly", "rotation": "weekly", "starts_at": now - timedelta(days=1), "ends_at": None,
              "users": ["alice"]}
    schedule = schedule_save(instance=None, fields={"name": "primary", "time_zone": "UTC", "description": ""},
                             layers=[weekly], actor=None)
    return {"rollout": rollout, "slo": slo, "alert": Alert.objects.get(slo=slo, severity="page"),
            "schedule": schedule}


def test_the_home_page_shows_each_part_and_links_to_its_page(live_server, page, page_errors, platform, tmp_path):
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
    assert page_errors == []


GREEN = "rgb(220, 252, 231)"  # .state-ready and .health-healthy
RED = "rgb(254, 226, 226)"  # .health-unhealthy


def background(locator) -> str:
    return locator.evaluate("el => getComputedStyle(el).backgroundColor")


@pytest.fixture
def overview(settings):
    """`chat`, ready at 1 / 2 with no traffic yet; a viewer to watch it."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("look", password="pw-look-123456").groups.add(Group.objects.get(name="viewer"))
    chat = make_deployment("chat")
    Deployment.objects.filter(pk=chat.pk).update(replicas=2, status="progressing")
    Replica.objects.create(deployment=chat, version=chat.version, node="test", state=ReplicaState.READY)
    starting = Replica.objects.create(deployment=chat, version=chat.version, node="test",
                                      state=ReplicaState.STARTING)
    return chat, starting


@pytest.mark.parametrize(("path", "rows"), [("/", "#deployments-panel"), ("/deployments/", "#deployments")])
def test_the_overview_follows_traffic_replicas_and_health_without_a_reload(live_server, page, page_errors, overview,
                                                                          path, rows):
    chat, starting = overview
    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}{path}")
    row = page.locator(f"{rows} tr[data-name=chat]")
    expect(row.locator(".req-rate")).to_have_text("0")
    expect(row.locator(".replicas")).to_have_text("1 / 2")
    expect(row.locator(".health")).to_have_attribute("data-health", "at-risk")
    expect(page.locator("[data-live-stamp]")).to_contain_text("refreshes every 5 s")
    first_stamp = page.locator("[data-live-stamp]").inner_text()
    page.evaluate("window.notReloaded = true")

    # Traffic arrives (30 requests in the 5-minute window: 0.10/s) and the second replica turns ready.
    now = timezone.now()
    insert_events([event(now - timedelta(seconds=3), ttft_ms=120.0) for _ in range(30)])
    Replica.objects.filter(pk=starting.pk).update(state=ReplicaState.READY)
    Deployment.objects.filter(pk=chat.pk).update(status="ready")
    expect(row.locator(".req-rate")).to_have_text("0.10", timeout=20000)
    expect(row.locator(".replicas")).to_have_text("2 / 2")
    expect(row.locator(".error-rate .freshness")).to_contain_text("s ago")
    expect(row.locator(".health")).to_have_attribute("data-health", "healthy")
    assert page.locator("[data-live-stamp]").inner_text() != first_stamp

    # Its SLO budget runs out and the policy degrades it: still `ready`, but not green any more.
    slo = Slo.objects.create(name="chat-ttft", deployment=chat, sli_kind="latency", ttft_ms=150, objective=0.99)
    SloStatus.objects.create(slo=slo, state="exhausted", budget_remaining=-0.2, evaluated_at=timezone.now(),
                             burn_rates={"1h": 20.0, "6h": 8.0})
    Deployment.objects.filter(pk=chat.pk).update(degradation={"level": 2, "name": "shed-batch"})
    health = row.locator(".health")
    expect(health).to_have_attribute("data-health", "unhealthy", timeout=20000)
    expect(health.locator(".state")).to_have_text("unhealthy")
    expect(health.locator(".reasons")).to_have_text("SLO chat-ttft budget exhausted; degraded to level 2 (shed-batch)")
    assert background(health.locator(".state")) == RED
    assert background(row.locator(".status .state")) == GREEN  # the replicas are ready: that stays a fact
    assert page.evaluate("window.notReloaded") is True
    assert page_errors == []


def test_a_failed_refresh_says_stale_quietly_and_recovers(live_server, page, overview):
    log_in(page, live_server.url, "look", "pw-look-123456")
    stamp = page.locator("[data-live-stamp]")
    # The network drops the refreshes (a proxy gone, a laptop asleep): the page keeps its numbers.
    page.route("**/", lambda route: route.abort() if route.request.headers.get("x-live") else route.continue_())
    expect(stamp).to_contain_text("stale", timeout=20000)
    assert "stale" in stamp.get_attribute("class")
    expect(page.locator("#deployments-panel tr[data-name=chat] .replicas")).to_have_text("1 / 2")
    page.unroute("**/")
    expect(stamp).to_contain_text("refreshes every 5 s", timeout=20000)
    assert "stale" not in stamp.get_attribute("class")


def test_typing_in_a_live_region_pauses_its_refresh(live_server, page, overview):
    chat, starting = overview
    log_in(page, live_server.url, "look", "pw-look-123456")
    # A field inside the region (as a panel's form would have), focused and typed into.
    page.evaluate("""() => { const input = document.createElement('input'); input.id = 'typing';
                             document.getElementById('deployments-panel').appendChild(input); }""")
    page.fill("#typing", "half a reason")
    Replica.objects.filter(pk=starting.pk).update(state=ReplicaState.READY)
    expect(page.locator("[data-live-stamp]")).to_contain_text("paused while you use the page", timeout=20000)
    expect(page.locator("#typing")).to_have_value("half a reason")
    expect(page.locator("#deployments-panel tr[data-name=chat] .replicas")).to_have_text("1 / 2")
    page.locator("#typing").blur()
    expect(page.locator("#deployments-panel tr[data-name=chat] .replicas")).to_have_text("2 / 2", timeout=20000)


def test_a_success_message_reads_as_success_and_the_favicon_is_served(live_server, page, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("root", password="pw-root-123456").groups.add(Group.objects.get(name="admin"))
    bob = User.objects.create_user("bob")
    bob.groups.add(Group.objects.get(name="viewer"))
    log_in(page, live_server.url, "root", "pw-root-123456")
    page.goto(f"{live_server.url}/users/")
    row = page.locator("tr", has_text="bob")
    row.locator("select[name=role]").select_option("operator")
    row.locator("button[type=submit]", has_text="Change").click()
    message = page.locator(".messages li")
    expect(message).to_have_text("bob is now operator (was viewer).")
    expect(message).to_have_class("success")
    assert background(message) == "rgb(240, 253, 244)"  # green, not the warning's orange

    # The icon every page links: a 200 with an image Chromium decodes, not a 404.
    assert page.locator("link[rel=icon]").get_attribute("href") == "/favicon.ico"
    status = page.evaluate("fetch('/favicon.ico').then(r => r.status)")
    width = page.evaluate("""new Promise((done, failed) => { const icon = new Image();
        icon.onload = () => done(icon.naturalWidth); icon.onerror = failed; icon.src = '/favicon.ico'; })""")
    assert (status, width) == (200, 32)
