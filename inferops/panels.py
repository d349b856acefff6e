"""Panels one app adds to another app's page, so the page's app need not import it (a lower
layer's page showing what a higher layer knows), and where their forms send the operator back."""

from __future__ import annotations

from collections.abc import Callable

from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString

# Each takes (request, the page's object) and returns rendered HTML, or "" for nothing to show.
Panel = Callable[..., SafeString | str]


class PanelRegistry:
    def __init__(self) -> None:
        self._panels: list[tuple[int, Panel]] = []

    def register(self, panel: Panel, position: int = 100) -> None:
        """Panels show by position, then in the order apps registered them (INSTALLED_APPS')."""
        if all(panel != known for _, known in self._panels):
            self._panels.append((position, panel))
            self._panels.sort(key=lambda entry: entry[0])

    def render(self, request, obj) -> list[str]:
        return [html for _, panel in self._panels if (html := panel(request, obj))]


# The home page: each app adds what a person wants to see first (who is on call, what burns).
# Panels take (request, None).
home_panels = PanelRegistry()

# A model version's page: what the apps above the registry know about one version (its eval
# scores next to its parent's). Panels take (request, the ModelVersion).
version_panels = PanelRegistry()

# A tenant's page: what the apps above tenants know about one tenant (its offline batches).
# Panels take (request, the Tenant).
tenant_panels = PanelRegistry()


def safe_next(request) -> str | None:
    """The `next` a panel's form posted (the page it sits on), if it is a path of this site."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                                  require_https=request.is_secure()):
        return target
    return None
