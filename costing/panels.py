"""The home page's cost panel: this month's cost so far, from the same report the cost page shows
(costing.api.current_report), so the two never disagree."""

from __future__ import annotations

from django.template.loader import render_to_string

from costing.api import current_report
from costing.report import report_in_cents

COSTS = 40  # home page position: after what burns


def home_panel(request, _obj) -> str:
    report, start, _ = current_report({})
    return render_to_string("costing/_home_cost.html", {"report": report_in_cents(report), "month": start},
                            request=request)
