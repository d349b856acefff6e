"""The bearer token of built-in replicas' admin API (/admin/faults, /admin/slo-targets).

The drivers give every built-in replica this token in its environment (INFEROPS_ADMIN_TOKEN, never
on the command line, where `ps` shows it), and the control plane sends it when it sets a replica's
SLO targets. An operator's own INFEROPS_ADMIN_TOKEN wins, so game-day scripts keep working;
otherwise it is derived from SECRET_KEY, so the worker that started a replica and the one that
talks to it later agree without storing it.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from django.conf import settings

ADMIN_TOKEN_ENV = "INFEROPS_ADMIN_TOKEN"


def replica_admin_token() -> str:
    configured = os.environ.get(ADMIN_TOKEN_ENV)
    if configured:
        return configured
    return hmac.new(settings.SECRET_KEY.encode(), b"inferops replica admin API", hashlib.sha256).hexdigest()


def replica_admin_token_digest() -> str:
    """Changes whenever the token does, and reveals nothing of it: keyed with SECRET_KEY, so even
    an operator's short token cannot be guessed from it offline."""
    return hmac.new(settings.SECRET_KEY.encode(), b"digest " + replica_admin_token().encode(),
                    hashlib.sha256).hexdigest()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {replica_admin_token()}"}
