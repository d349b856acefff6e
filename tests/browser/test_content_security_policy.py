"""Every console page works under its Content-Security-Policy (issue 40), in a real Chromium: a crawl
from the home page, as an admin, opens one page of each URL pattern its links reach (charts, live
refresh, the API docs and the Django admin included) and counts the policy's violations: none.
A control proves the count works: an inline handler added to a page is refused and counted."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urljoin, urlparse

import pytest
from django.contrib.auth.models import User
from django.urls import Resolver404, resolve
from django.utils import timezone
from playwright.sync_api import Error as PlaywrightError

from batches.choices import BatchStatus
from batches.models import Batch
from tenants import services as tenant_services
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

WATCH_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", e =>
  window.__csp.push(`${e.violatedDirective} blocked ${e.blockedURI || "inline"} at ${e.sourceFile}:${e.lineNumber}`));
"""
# Pages a crawl must not open: they act (log out) or only download.
SKIPPED = {"logout", "plotly-js", "favicon", "metrics", "schema", "batch-file-download"}
MAX_CONSOLE_PAGES, MAX_ADMIN_PAGES = 40, 8


def url_name(path: str) -> str | None:
    try:
        match = resolve(path)
    except Resolver404:
        return None
    return f"{match.namespace}:{match.url_name}" if match.namespace else match.url_name


def links(page, base: str) -> list[str]:
    hrefs = page.eval_on_selector_all("a[href]", "anchors => anchors.map(a => a.getAttribute('href'))")
    found = []
    for href in hrefs:
        url = urlparse(urljoin(page.url, href))
        if url.netloc == urlparse(base).netloc and url.path:
            found.append(url.path)
    return found


def test_every_page_a_crawl_reaches_works_under_the_policy(live_server, browser, burning_alert):
    User.objects.create_superuser("csp-admin", "", "pw-csp-12345678")
    tenant = tenant_services.tenant_create(name="acme", actor=None)
    key, _ = tenant_services.key_create(tenant=tenant, name="ci", actor=None,
                                        deployments=[burning_alert.slo.deployment.name])
    # A batch in progress: the batch pages draw its progress bar and refresh themselves.
    now = timezone.now()
    Batch.objects.create(tenant=tenant, api_key=key, key_prefix=key.prefix, endpoint="/v1/chat/completions",
                         completion_window="24h", model=burning_alert.slo.deployment.name, input_file_ref="file-gone",
                         status=BatchStatus.IN_PROGRESS, total=10, completed=3, in_progress_at=now,
                         expires_at=now + timedelta(days=1))
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(WATCH_VIOLATIONS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"{page.url}: {error}"))
    violations: list[str] = []
    try:
        log_in(page, live_server.url, "csp-admin", "pw-csp-12345678")
        # The console's pages first, then a few of the Django admin's (it has dozens alike).
        queues = {"console": ["/", "/api/docs/"], "admin": ["/admin/"]}
        limits = {"console": MAX_CONSOLE_PAGES, "admin": MAX_ADMIN_PAGES}
        seen_names, visited = set(), {"console": [], "admin": []}
        while True:
            part = next((p for p in ("console", "admin") if queues[p] and len(visited[p]) < limits[p]), None)
            if part is None:
                break
            path = queues[part].pop(0)
            name = url_name(path)
            if name is None or name in seen_names or name.split(":")[-1] in SKIPPED:
                continue
            seen_names.add(name)
            try:
                response = page.goto(f"{live_server.url}{path}")
            except PlaywrightError as error:  # an export (CSV, PDF) downloads instead of showing
                if "Download is starting" in str(error):
                    continue
                raise
            assert response.status < 500, f"{path}: {response.status}"
            page.wait_for_load_state("load")
            if page.locator("[id^=chart], .chart, .js-plotly-plot").count():
                page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length > 0", timeout=15_000)
            if path == "/api/docs/":
                page.wait_for_selector(".swagger-ui .info", timeout=15_000)
            page.wait_for_timeout(200)  # violations are reported asynchronously
            violations += [f"{path}: {v}" for v in page.evaluate("window.__csp")]
            visited[part].append(path)
            for link in links(page, live_server.url):
                queues["admin" if link.startswith("/admin/") else "console"].append(link)
        print(f"under the CSP: {visited}")
        assert len(visited["console"]) >= 15 and len(visited["admin"]) >= 5, visited  # the crawl went round
        assert {"slo:detail", "deployments:detail", "alerts:detail", "api-docs", "admin:index", "batch-list",
                "batch-detail"} <= seen_names
        assert violations == []
        assert errors == []

        # The control: an inline handler is refused, and counted.
        page.evaluate("""document.body.insertAdjacentHTML(
            "beforeend", '<img src="/nowhere.png" onerror="window.ran = 1">')""")
        page.wait_for_function("() => window.__csp.length > 0", timeout=5_000)
        assert page.evaluate("window.ran") is None
    finally:
        context.close()
