"""Failed sign-ins, counted per account and per client address, refuse further tries for a while.

One form mixin serves the console's login page and the Django admin's. Counts live in the
cache (Redis), so every web process shares them; while Redis is down sign-ins are not limited
(logged), as the control plane then works without its cache.
"""

from __future__ import annotations

import logging
import math
import time

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from django.core.exceptions import ValidationError

log = logging.getLogger(__name__)
PREFIX = "inferops:login-failures"


def client_address(request) -> str:
    """The client's address: REMOTE_ADDR, or with INFEROPS_TRUSTED_PROXIES = n proxies in front, the
    address the outermost of them saw (n-th from the right of X-Forwarded-For); a client can
    prepend to that header, never append, so entries left of it are not trusted."""
    proxies = settings.INFEROPS_TRUSTED_PROXIES
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    if proxies and len(forwarded) >= proxies:
        return forwarded[-proxies]
    return request.META.get("REMOTE_ADDR", "")


def _scopes(username: str, address: str) -> list[tuple[str, str, int]]:
    """(cache key, what it counts, limit) per scope."""
    return [(f"{PREFIX}:account:{username.strip().lower()}", "this account",
             settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT),
            (f"{PREFIX}:address:{address}", "this address", settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ADDRESS)]


def refusal(username: str, address: str) -> tuple[str, int] | None:
    """(message, seconds to wait) when either scope has used up its failures in this window, else None."""
    for key, what, limit in _scopes(username, address):
        found = cache.get_many([key, f"{key}:since"])
        failures, since = found.get(key, 0), found.get(f"{key}:since")
        if failures >= limit and since is not None:
            wait_s = max(1, math.ceil(since + settings.INFEROPS_LOGIN_LOCKOUT_S - time.time()))
            minutes = math.ceil(wait_s / 60)
            plural = "s" if minutes != 1 else ""
            return (f"Too many failed sign-ins from {what}: try again in {minutes} minute{plural}, "
                    "or ask an admin to reset the password.", wait_s)
    return None


def record_failure(username: str, address: str) -> None:
    """Count one failure in both scopes; a scope's window starts at its first failure."""
    window = settings.INFEROPS_LOGIN_LOCKOUT_S
    for key, _, _ in _scopes(username, address):
        cache.add(f"{key}:since", time.time(), window)
        cache.add(key, 0, window)
        cache.incr(key)


def clear_account(username: str) -> None:
    """A successful sign-in forgets the account's failures (not the address's: one good password
    does not vouch for an address that guesses others)."""
    key = _scopes(username, "")[0][0]
    cache.delete_many([key, f"{key}:since"])


def _unless_cache_down(work, *args):
    try:
        return work(*args)
    except Exception:  # noqa: BLE001 - the cache (Redis) is down: sign-ins go unlimited, said in the log
        log.warning("login rate limiting is off: the cache is unavailable", exc_info=True)
        return None


class RateLimitedLogin:
    """For an AuthenticationForm: refuses (code "rate_limited") before checking the password while a
    scope is over its limit, and counts each wrong password."""

    retry_after_s: int | None = None

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        address = client_address(self.request) if self.request else ""
        refused = _unless_cache_down(refusal, username, address)
        if refused:
            self.retry_after_s = refused[1]
            raise ValidationError(refused[0], code="rate_limited")
        try:
            cleaned = super().clean()
        except ValidationError as error:
            if any(e.code == "invalid_login" for e in error.error_list):
                _unless_cache_down(record_failure, username, address)
            raise
        _unless_cache_down(clear_account, username)
        return cleaned


class LoginForm(RateLimitedLogin, AuthenticationForm):
    pass


class AdminLoginForm(RateLimitedLogin, AdminAuthenticationForm):
    pass


class LoginView(auth_views.LoginView):
    """The console's login page; a refused sign-in answers 429 with Retry-After."""

    form_class = LoginForm

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.retry_after_s:
            response.status_code = 429
            response["Retry-After"] = str(form.retry_after_s)
        return response
