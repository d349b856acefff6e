"""Panels other apps add to the deployment page, so deployments need not import them (a
degradation policy is judged on SLOs, which depend on deployments).

Deployments also adds the home page's deployment panel (registered here, as alerts does its own:
the console's URLconf and degradation's ready() import this module before any page renders)."""

from django.template.loader import render_to_string

from deployments.overview import deployment_health
from inferops.panels import PanelRegistry, home_panels

_registry = PanelRegistry()
register = _registry.register
render_panels = _registry.render

DEPLOYMENTS = 20  # home page position: after what is firing and who is on call


def home_panel(request, _obj) -> str:
    """Every deployment's health, its rollout in progress and degradation level."""
    rows = deployment_health()
    return render_to_string("deployments/_home_deployments.html", {"rows": rows}, request=request)


home_panels.register(home_panel, DEPLOYMENTS)
