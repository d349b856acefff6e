"""HTTP transport shared by the webhook, PagerDuty and Slack receivers, and the Alertmanager
(version 4) payload of the webhook kind.

One `post_json()` and one error type that says whether retrying can help: 5xx, 429, timeouts and
connection failures are temporary; any other 4xx (a wrong URL or key, a rejected payload) is
permanent. The email receiver raises the same error for SMTP failures.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from alerts.choices import AlertStatus

USER_AGENT = "inferops-alerts/1"


class DeliveryError(Exception):
    def __init__(self, message: str, *, permanent: bool, http_status: int | None = None):
        super().__init__(message)
        self.permanent = permanent
        self.http_status = http_status


def rfc3339(moment) -> str:
    # Alertmanager writes the zero time for an alert that has not ended.
    return moment.isoformat().replace("+00:00", "Z") if moment else "0001-01-01T00:00:00Z"


def absolute(link: str, base: str) -> str:
    """A console path under the external URL; a link that is already absolute as it is."""
    return link if urlsplit(link).scheme else f"{base}{link}"


def _common(dicts: list[dict]) -> dict:
    first, *rest = dicts
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in rest)}


def alertmanager_payload(*, alerts: list, receiver: str, status: str, external_url: str, group=None) -> dict:
    """The body Alertmanager's webhook receiver sends for a group (by default, one grouped by
    alertname and slo). `status` is the transition announced; an acknowledgement reads as
    firing, since Alertmanager's format knows only firing and resolved."""
    if group is not None:
        group_labels, route = group.labels, "{}" if group.route.is_default else f"{{}}/route-{group.route_id}"
    else:
        group_labels, route = {k: alerts[0].labels[k] for k in ("alertname", "slo") if k in alerts[0].labels}, "{}"
    payload_status = AlertStatus.RESOLVED if status == AlertStatus.RESOLVED else AlertStatus.FIRING
    base = external_url.rstrip("/")
    return {
        "version": "4",
        "groupKey": f"{route}:{{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}",
        "truncatedAlerts": 0,
        "status": payload_status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": _common([a.labels for a in alerts]),
        "commonAnnotations": _common([a.annotations for a in alerts]),
        "externalURL": base,
        "alerts": [
            {
                "status": payload_status,
                "labels": alert.labels,
                "annotations": alert.annotations,
                "startsAt": rfc3339(alert.starts_at),
                "endsAt": rfc3339(alert.ends_at if status == AlertStatus.RESOLVED else None),
                "generatorURL": absolute(alert.source_link() or alert.get_absolute_url(), base),
                "fingerprint": alert.fingerprint,
            }
            for alert in alerts
        ],
    }


def post_json(url: str, payload: dict, *, timeout_s: float) -> int:
    """POST the payload; returns the HTTP status or raises DeliveryError."""
    try:
        response = httpx.post(url, json=payload, timeout=timeout_s, headers={"User-Agent": USER_AGENT})
    except httpx.TimeoutException as exc:
        raise DeliveryError(f"timeout after {timeout_s:g} s: {exc!r}", permanent=False) from exc
    except httpx.TransportError as exc:
        raise DeliveryError(f"connection failed: {exc!r}", permanent=False) from exc
    if response.is_success:
        return response.status_code
    temporary = response.status_code >= 500 or response.status_code == 429
    raise DeliveryError(f"HTTP {response.status_code}: {response.text[:500]}", permanent=not temporary,
                        http_status=response.status_code)
