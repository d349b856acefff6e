"""The home page's cost panel: this month's cost so far, from the same report the cost page shows
(costing.api.current_report), so the two never disagree."""

from __future__ import annotations

from django.core.cache import cache
from django.template.loader import render_to_string

from costing.api import current_report
from costing.report import report_in_cents

COSTS = 40  # home page position: after what burns
# The home page refreshes itself every few seconds (X-Live); a month's report is too heavy to rebuild
# for every open tab each time, so refreshes share one rendering a minute. A page load is always fresh.
LIVE_CACHE_KEY = "costing:home-panel"
LIVE_CACHE_SECONDS = 60


def render_panel(request) -> str:
    report, start, _ = current_report({})
    return render_to_string("costing/_home_cost.html", {"report": report_in_cents(report), "month": start},
                            request=request)


def home_panel(request, _obj) -> str:
    if not request.headers.get("X-Live"):
        html = render_panel(request)
        cache.set(LIVE_CACHE_KEY, html, LIVE_CACHE_SECONDS)
        return html
    return cache.get_or_set(LIVE_CACHE_KEY, lambda: render_panel(request), LIVE_CACHE_SECONDS)
