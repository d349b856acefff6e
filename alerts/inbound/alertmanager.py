"""Alerts from outside the platform and Alertmanager's silences.

An `Integration` is an outside source (a team's Alertmanager) posting Alertmanager's webhook
payload (version 4) with its own bearer token; only the token's sha256 is stored, as for API
keys. Each posted alert is deduplicated by the fingerprint of its labels as inferops computes it
(Alertmanager's own fingerprint is ignored: it is not the same hash), so a re-sent group or a
retried POST opens nothing new. Silences keep Alertmanager API v2's shape; expiring one ends it
now, and an expired silence stays as history.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from datetime import datetime

from django.db import IntegrityError, transaction
from django.utils import timezone

from alerts.choices import OPEN_STATUSES, Severity
from alerts.models import Alert, Integration, Silence, fingerprint_of
from alerts.services import alert_raise, alert_resolve
from alerts.silences.muting import matcher_holds
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from runtime.gateway.contract import hash_api_key

TOKEN_PREFIX = "ioa_"
# A label severity that pages; any other value (warning, info, ticket, none) opens a ticket.
PAGE_SEVERITIES = frozenset({"page", "critical", "error"})


# ---------------------------------------------------------------------------- integrations


def integration_create(*, name: str, actor) -> tuple[Integration, str]:
    """A new integration and its token, which is returned here once and never stored."""
    token = f"{TOKEN_PREFIX}{secrets.token_urlsafe(30)}"
    integration = Integration(name=name, token_prefix=token[:12], token_hash=hash_api_key(token),
                              created_by=actor_or_none(actor))
    try:
        with transaction.atomic():
            integration.save()
            audit_record(actor=actor, action="integration.create", obj=integration,
                         after=snapshot(integration) | {"token_hash": "(hidden)"})
    except IntegrityError:
        raise Conflict(f"An integration named {name!r} already exists (deactivated ones keep their name).") from None
    return integration, token


def integration_delete(*, integration: Integration, actor) -> Integration:
    """Deactivate: its token stops working at once; the row stays so its alerts keep their source."""
    with transaction.atomic():
        locked = Integration.objects.select_for_update().get(pk=integration.pk)
        if not locked.active:
            raise Conflict(f"Integration {locked.name!r} is already deactivated.")
        locked.active = False
        locked.save(update_fields=["active"])
        audit_record(actor=actor, action="integration.deactivate", obj=locked, before={"active": True},
                     after={"active": False})
    return locked


def integration_for_token(token: str) -> Integration | None:
    return Integration.objects.filter(token_hash=hash_api_key(token)).first()


# ---------------------------------------------------------------------------- Alertmanager's webhook


@dataclass
class IngestCounts:
    opened: int = 0
    updated: int = 0
    resolved: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def severity_from_labels(labels: dict[str, str]) -> str:
    """Alertmanager's `severity` label as our two: page/critical/error page, anything else is a ticket."""
    return Severity.PAGE if labels.get("severity", "").strip().lower() in PAGE_SEVERITIES else Severity.TICKET


def alertmanager_ingest(*, integration: Integration, alerts: list[dict], now: datetime) -> IngestCounts:
    """Apply one validated payload's alerts, all or nothing. Each alert is a dict with `status`
    ("firing" or "resolved"), `labels`, `annotations`, `starts_at`, `ends_at` (None when unset)
    and `generator_url`. Firing opens or updates the open alert of its label set; resolved ends
    it if one is open (else nothing: resolving twice is a no-op)."""
    for attempt in range(2):
        try:
            with transaction.atomic():
                return _ingest(integration, alerts, now)
        except IntegrityError:
            # Another payload opened the same label set between our check and our insert; once
            # more sees its row and updates it.
            if attempt:
                raise
    raise AssertionError("unreachable")


def _ingest(integration: Integration, alerts: list[dict], now: datetime) -> IngestCounts:
    counts = IngestCounts()
    actor_name = f"integration {integration.name}"
    for posted in alerts:
        labels = posted["labels"]
        open_alert = Alert.objects.filter(fingerprint=fingerprint_of(labels), status__in=OPEN_STATUSES).first()
        if posted["status"] == "firing":
            alert = alert_raise(labels=labels, annotations=posted["annotations"], severity=severity_from_labels(labels),
                                now=now, integration=integration, generator_url=posted["generator_url"])
            if open_alert is None:
                counts.opened += 1
                # When it began is Alertmanager's to say (it may have waited group_wait, or retried).
                if posted["starts_at"] and posted["starts_at"] < now:
                    Alert.objects.filter(pk=alert.pk).update(starts_at=posted["starts_at"])
            else:
                counts.updated += 1
        elif open_alert is not None:
            ends_at = posted["ends_at"] or now
            ends_at = min(max(ends_at, open_alert.starts_at), now)
            alert_resolve(alert=open_alert, now=ends_at, annotations=posted["annotations"] or None,
                          actor_name=actor_name)
            counts.resolved += 1
    Integration.objects.filter(pk=integration.pk).update(last_used_at=now)
    return counts


# ---------------------------------------------------------------------------- silences


def silence_state(silence: Silence, now: datetime) -> str:
    if silence.ends_at <= now:
        return "expired"
    return "pending" if silence.starts_at > now else "active"


def silence_create(*, matchers: list[dict], starts_at: datetime, ends_at: datetime, created_by: str, comment: str,
                   actor) -> Silence:
    with transaction.atomic():
        silence = Silence.objects.create(matchers=matchers, starts_at=starts_at, ends_at=ends_at,
                                         created_by=created_by, comment=comment,
                                         author=actor_or_none(actor))
        audit_record(actor=actor, action="silence.create", obj=silence, after=snapshot(silence))
    return silence


def silence_update(*, silence: Silence, matchers: list[dict], starts_at: datetime, ends_at: datetime,
                   created_by: str, comment: str, actor, now: datetime | None = None) -> Silence:
    """Alertmanager's update: a silence with the same matchers is changed in place (an active one
    keeps its start, so extending or shortening it never reopens a gap); new matchers, or a new
    start for an active one, expire it and create a new silence, which is returned."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = Silence.objects.select_for_update().get(pk=silence.pk)
        if locked.ends_at <= now:
            raise Conflict(f"Silence {locked.pk} has expired: create a new one instead.")
        active = locked.starts_at <= now
        if _canonical(locked.matchers) != _canonical(matchers) or (active and starts_at > now):
            silence_expire(silence=locked, actor=actor, now=now)
            return silence_create(matchers=matchers, starts_at=starts_at, ends_at=ends_at, created_by=created_by,
                                  comment=comment, actor=actor)
        before = snapshot(locked)
        locked.starts_at = locked.starts_at if active else starts_at
        locked.ends_at, locked.created_by, locked.comment = ends_at, created_by, comment
        locked.save(update_fields=["starts_at", "ends_at", "created_by", "comment", "updated_at"])
        audit_record(actor=actor, action="silence.update", obj=locked, before=before, after=snapshot(locked))
    return locked


def _canonical(matchers: list[dict]) -> list[tuple]:
    return sorted((m["name"], m["value"], bool(m.get("isRegex")), m.get("isEqual", True)) for m in matchers)


def silence_expire(*, silence: Silence, actor, now: datetime | None = None) -> Silence:
    """End it now (a pending one ends before it began); muted alerts notify at the next sweep."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = Silence.objects.select_for_update().get(pk=silence.pk)
        if locked.ends_at <= now:
            raise Conflict(f"Silence {locked.pk} has already expired.")
        before = snapshot(locked)
        locked.starts_at, locked.ends_at = min(locked.starts_at, now), now
        locked.save(update_fields=["starts_at", "ends_at", "updated_at"])
        audit_record(actor=actor, action="silence.expire", obj=locked, before=before, after=snapshot(locked))
    return locked


def alerts_silenced_by(silence: Silence, open_alerts: list[Alert]) -> list[Alert]:
    """The open alerts (from `open_alerts`) that every matcher of the silence holds for."""
    return [alert for alert in open_alerts if all(matcher_holds(m, alert.labels) for m in silence.matchers)]
