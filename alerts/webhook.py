"""Webhook transport: an Alertmanager-compatible (version 4) JSON payload POSTed with httpx.

One `notify()` and one error type that says whether retrying can help: 5xx, 429, timeouts and
connection failures are temporary; any other 4xx (a wrong URL, a rejected payload) is permanent.
"""

from __future__ import annotations

import time

import httpx

from alerts.choices import AlertStatus

USER_AGENT = "inferops-alerts/1"


class WebhookError(Exception):
    def __init__(self, message: str, *, permanent: bool, http_status: int | None = None, duration_ms: float = 0.0):
        super().__init__(message)
        self.permanent = permanent
        self.http_status = http_status
        self.duration_ms = duration_ms


def _rfc3339(moment) -> str:
    # Alertmanager writes the zero time for an alert that has not ended.
    return moment.isoformat().replace("+00:00", "Z") if moment else "0001-01-01T00:00:00Z"


def _common(dicts: list[dict]) -> dict:
    first, *rest = dicts
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in rest)}


def alertmanager_payload(*, alerts: list, receiver: str, status: str, external_url: str) -> dict:
    """The body Alertmanager's webhook receiver sends, grouped by alertname and slo."""
    group_labels = {key: alerts[0].labels[key] for key in ("alertname", "slo") if key in alerts[0].labels}
    base = external_url.rstrip("/")
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a.labels for a in alerts]),
        "commonAnnotations": _common([a.annotations for a in alerts]),
        "externalURL": base,
        "alerts": [
            {
                "status": status,
                "labels": alert.labels,
                "annotations": alert.annotations,
                "startsAt": _rfc3339(alert.starts_at),
                "endsAt": _rfc3339(alert.ends_at if status == AlertStatus.RESOLVED else None),
                "generatorURL": f"{base}/slos/{alert.labels.get('slo', '')}/",
                "fingerprint": alert.fingerprint,
            }
            for alert in alerts
        ],
    }


def notify(url: str, payload: dict, *, timeout_s: float) -> tuple[int, float]:
    """POST the payload; returns (HTTP status, milliseconds) or raises WebhookError."""
    started = time.perf_counter()

    def elapsed_ms() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        response = httpx.post(url, json=payload, timeout=timeout_s, headers={"User-Agent": USER_AGENT})
    except httpx.TimeoutException as exc:
        raise WebhookError(f"timeout after {timeout_s:g} s: {exc!r}", permanent=False,
                           duration_ms=elapsed_ms()) from exc
    except httpx.TransportError as exc:
        raise WebhookError(f"connection failed: {exc!r}", permanent=False, duration_ms=elapsed_ms()) from exc
    if response.is_success:
        return response.status_code, elapsed_ms()
    temporary = response.status_code >= 500 or response.status_code == 429
    raise WebhookError(
        f"HTTP {response.status_code}: {response.text[:500]}", permanent=not temporary,
        http_status=response.status_code, duration_ms=elapsed_ms(),
    )
