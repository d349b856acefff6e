"""What the CI subcommands (`inferops rollout`, `inferops eval`) share: the REST API client built from
the environment, stamped lines, DRF's errors in words, and polling that rides out a blip.

    INFEROPS_URL    the control plane (default http://127.0.0.1:8000)
    INFEROPS_TOKEN  an API token (`manage.py drf_create_token <user>`)

Only httpx: no Django, so the subcommands run from any CI image with the package installed.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


def base_url() -> str:
    return (os.environ.get("INFEROPS_URL") or DEFAULT_URL).rstrip("/")


def api_client() -> httpx.Client:
    """A client that sends INFEROPS_TOKEN, when set, with every request."""
    headers = {"Accept": "application/json"}
    if token := os.environ.get("INFEROPS_TOKEN", ""):
        headers["Authorization"] = f"Token {token}"
    return httpx.Client(headers=headers, timeout=httpx.Timeout(30.0, connect=10.0))


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def say(text: str, stream=None) -> None:
    """One line with a UTC timestamp, as CI logs read best."""
    print(f"{stamp()} {text}", file=stream or sys.stdout, flush=True)


def error_message(response: httpx.Response) -> str:
    """DRF's error body as one line: `detail`, or `field: message; message` per field."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        if set(body) == {"detail"}:
            return str(body["detail"])
        parts = []
        for field, messages in body.items():
            for message in messages if isinstance(messages, list) else [messages]:
                text = str(message)
                # rollout_spec's messages already start with their field ("steps[1].pause: ...").
                named = field in ("detail", "non_field_errors") or text.startswith(field)
                parts.append(text if named else f"{field}: {text}")
        return "; ".join(parts)
    return "; ".join(map(str, body)) if isinstance(body, list) else str(body)


def say_unreachable(base: str, exc: Exception) -> None:
    say(f"error: cannot reach inferops at {base} ({exc.__class__.__name__}: {exc}). Check INFEROPS_URL, that "
        "the control plane is running, and that this machine can reach it.", sys.stderr)


def say_refused(response: httpx.Response, base: str, *, not_found: str) -> bool:
    """Says why the API refused (with what to check: `not_found` for a 404); True when the server
    itself failed (a 5xx), False when it refused the request."""
    message = error_message(response).rstrip(".")
    hint = ""
    if response.status_code == 401:
        hint = (" Check INFEROPS_TOKEN (a token from `manage.py drf_create_token`)." if os.environ.get("INFEROPS_TOKEN")
                else " INFEROPS_TOKEN is not set.")
    elif response.status_code == 403:
        hint = " The token's user needs the operator role."
    elif response.status_code == 404:
        hint = f" {not_found}"
    elif response.status_code >= 500:
        say(f"error: inferops at {base} failed with HTTP {response.status_code}: {message}. Check the server's "
            "logs.", sys.stderr)
        return True
    say(f"refused (HTTP {response.status_code}): {message}.{hint}", sys.stderr)
    return False


class Poller:
    """GETs of one URL while waiting: a network error or a 5xx warns once and answers None, so the
    caller keeps polling through a blip until its own deadline."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url
        self.failing = False

    def get(self) -> httpx.Response | None:
        try:
            response = self.client.get(self.url)
        except httpx.HTTPError as exc:
            self._warn(f"failed ({exc.__class__.__name__}: {exc})")
            return None
        if response.status_code >= 500:
            self._warn(f"answered HTTP {response.status_code}")
            return None
        self.failing = False
        return response

    def _warn(self, what: str) -> None:
        if not self.failing:
            say(f"warning: polling {self.url} {what}; retrying", sys.stderr)
        self.failing = True
