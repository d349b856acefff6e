"""The home page's cost panel: a page load builds this month's report; the page's live refreshes
(X-Live) share one rendering a minute instead of rebuilding the month for every open tab."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from costing import panels

pytestmark = pytest.mark.django_db


def test_live_refreshes_share_a_rendering_and_a_page_load_is_fresh(client, make_user, monkeypatch):
    cache.delete(panels.LIVE_CACHE_KEY)
    built = []
    real = panels.current_report
    monkeypatch.setattr(panels, "current_report", lambda params: built.append(1) or real(params))  # a spy
    client.force_login(make_user("viewer"))

    first = client.get("/")
    assert b'id="home-month-cost"' in first.content and len(built) == 1
    for _ in range(2):
        refreshed = client.get("/", headers={"X-Live": "1"})
        assert b'id="home-month-cost"' in refreshed.content
    assert len(built) == 1
    client.get("/")
    assert len(built) == 2


def test_a_live_refresh_with_nothing_cached_renders(client, make_user):
    cache.delete(panels.LIVE_CACHE_KEY)
    client.force_login(make_user("viewer"))
    assert b'id="home-month-cost"' in client.get("/", headers={"X-Live": "1"}).content
