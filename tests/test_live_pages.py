"""The pages that refresh themselves (templates/partials/live.html), server side: never cached, and
a refresh (X-Live: 1) leaves the session's messages for the next real page view; messages carry
their level; /favicon.ico is an icon a browser may keep."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/", "/deployments/"])
def test_live_pages_are_never_cached_and_carry_their_region(client, make_user, path):
    client.force_login(make_user("viewer"))
    response = client.get(path)
    assert "no-cache" in response["Cache-Control"] and "max-age=0" in response["Cache-Control"]
    assert b'data-live="5"' in response.content and b"data-live-stamp" in response.content


def test_a_live_refresh_does_not_swallow_a_message_and_each_shows_in_its_level(client, make_user):
    client.force_login(make_user("admin"))
    bob = make_user("viewer", "bob")
    client.post(f"/users/{bob.pk}/role/", {"role": "operator"})  # a success message, queued for the next page

    assert b"bob is now operator" not in client.get("/", headers={"X-Live": "1"}).content
    page = client.get("/").content.decode()
    assert '<li class="success" role="status">bob is now operator (was viewer).</li>' in page
    assert "bob is now operator" not in client.get("/").content.decode()  # shown once

    client.post(f"/users/{bob.pk}/role/", {"role": "emperor"})
    assert '<li class="error" role="alert">&#x27;emperor&#x27; is not a role' in client.get("/").content.decode()


def test_favicon_is_an_icon_cached_for_long(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/x-icon"
    assert response.content[:4] == b"\x00\x00\x01\x00"  # the ICO header
    assert "max-age=2592000" in response["Cache-Control"]
