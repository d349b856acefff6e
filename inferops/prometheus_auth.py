"""How Prometheus authenticates to inferops: a viewer's API token in its `authorization` block.

Shared by the service-discovery endpoint (deployments/replicas/prometheus_sd.py) and the control plane's
/metrics (project/metrics.py).
"""

from __future__ import annotations

from drf_spectacular.authentication import TokenScheme
from rest_framework.authentication import SessionAuthentication, TokenAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed


class BearerTokenAuthentication(TokenAuthentication):
    """The API token under the `Bearer` scheme, the only one Prometheus' `authorization` block sends.

    A bare token (`Authorization: <token>`) is accepted too: that is what an `http_sd_config` whose
    `authorization` leaves out `type` sends, although the documentation says Bearer is the default
    (prometheus/prometheus#12762; seen with Debian's 2.42)."""

    keyword = "Bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if len(parts) == 1 and parts[0].lower() not in (b"bearer", b"token", b"basic"):
            try:
                return self.authenticate_credentials(parts[0].decode("ascii"))
            except UnicodeError:
                raise AuthenticationFailed("Invalid token header.") from None
        return super().authenticate(request)


class BearerTokenScheme(TokenScheme):
    """Its own OpenAPI security scheme: DRF's token scheme would claim the subclass under its name."""

    target_class = BearerTokenAuthentication
    name = "bearerTokenAuth"
    match_subclasses = False
    priority = 0


# Bearer first: its challenge is the WWW-Authenticate header a refused scrape gets.
SCRAPER_AUTHENTICATION = [BearerTokenAuthentication, TokenAuthentication, SessionAuthentication]
