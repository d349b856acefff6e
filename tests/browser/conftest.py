import os
import shutil

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from alerts.models import Alert
from degradation import services as degradation_services
from slo.services import slo_create
from slo.tasks import evaluation_cycle
from tests.degradation.conftest import LEVELS
from tests.slo.conftest import event, insert_events, make_deployment

# Playwright's sync API keeps an event loop running in the test thread, and Django refuses ORM
# calls from a thread with a running loop. The tests' own ORM calls are plain synchronous set-up.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a closed network: no background calls home that would be refused by the dozen.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    # Module scope, not session: Playwright's sync API keeps an asyncio loop running in this
    # thread while it is open, and later tests that call asyncio.run() would find it.
    if not shutil.which("chromium"):
        pytest.fail("Debian's chromium is not installed (.ci/deps installs it: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture
def page_errors(page) -> list[str]:
    """The uncaught script errors `page` meets, for a test to assert there were none."""
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    return errors


def log_in(page, base_url: str, username: str, password: str, *, succeeds: bool = True) -> None:
    """Log in through the form; a login that succeeds returns on the home page it leads to."""
    page.goto(f"{base_url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    if succeeds:
        page.wait_for_url(f"{base_url}/")


@pytest.fixture
def burning_alert(settings):
    """A TTFT SLO burning at 50x this minute on a deployment with a degradation policy: evaluation
    opens the page alert. No receiver: nothing is sent anywhere."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = User.objects.create_user("oncall", password="pw-oncall-123456")
    user.groups.add(Group.objects.get(name="operator"))
    deployment = make_deployment()
    slo = slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", min_requests=10, runbook_url="https://runbooks.example/ttft")
    degradation_services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60,
                                     slos=[slo], levels=LEVELS)
    now = timezone.now()
    insert_events([event(now, ttft_ms=100.0) for _ in range(20)] + [event(now, ttft_ms=400.0) for _ in range(20)])
    evaluation_cycle(now=now)
    return Alert.objects.get(slo=slo, severity="page")
