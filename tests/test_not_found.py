"""A page that is not there: the console answers a 404 page in its own layout (like its 403), the
REST API and OpenAI-style paths answer DRF's JSON shape, and an SLO's page named by its name (how
alert links read before SLO pages were addressed by id) leads to the page by id."""

from __future__ import annotations

import pytest
from django.test import Client

from slo.services import slo_create
from tests.slo.conftest import make_deployment

pytestmark = pytest.mark.django_db

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def console(make_user) -> Client:
    client = Client()
    client.force_login(make_user("viewer"))
    return client


@pytest.mark.parametrize("path", ["/no-such-page/", "/slos/999999/", "/deployments/no-such-deployment/",
                                  "/alerts/999999/", "/slos/no-such-slo/", "/batches/batch_nope/",
                                  "/batches/files/file-nope/download/"])
def test_a_console_page_that_is_not_there_is_a_404_in_the_console_layout(console, path):
    response = console.get(path, headers={"accept": BROWSER_ACCEPT})
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    assert 'id="not-found"' in page and f"<code>{path}</code>" in page
    assert "<nav" in page and "<title>Not found · inferops</title>" in page


def test_signed_out_the_404_page_is_still_styled_and_offers_no_console_links():
    response = Client().get("/no-such-page/")
    assert response.status_code == 404
    page = response.content.decode()
    assert 'id="not-found"' in page and 'href="/slos/"' not in page


@pytest.mark.parametrize("path", ["/api/v1/no-such-route/", "/api/v1/slos/999999/", "/api/v1/deployments/nope/",
                                  "/v1/chat/completions", "/v1/models"])
def test_api_and_openai_style_paths_answer_json_404s(api, path):
    response = api("viewer").get(path, headers={"accept": BROWSER_ACCEPT})  # even from a browser
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert set(response.json()) == {"detail"} and response.json()["detail"]


def test_a_client_that_takes_only_json_gets_json_on_a_console_path(console):
    response = console.get("/no-such-page/", headers={"accept": "application/json"})
    assert response.status_code == 404 and response.json() == {"detail": "Not found: nothing at /no-such-page/."}


def test_an_slo_named_in_an_old_link_redirects_to_its_page_by_id(console):
    slo = slo_create(actor=None, name="chat-ttft", deployment=make_deployment(), sli_kind="latency", ttft_ms=500.0,
                     objective=0.99, window="1d")
    response = console.get("/slos/chat-ttft/")
    assert response.status_code == 302 and response["Location"] == f"/slos/{slo.pk}/"
    assert console.get(response["Location"]).status_code == 200
    # Signed out, the redirect says nothing about which names exist: log in first.
    assert Client().get("/slos/chat-ttft/")["Location"].startswith("/login/")
