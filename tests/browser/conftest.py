import os
import shutil

import pytest

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
