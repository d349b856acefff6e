"""An alert's timeline: one entry per state change, comment or notification, and by whom."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from alerts.models import Alert, AlertEvent
from inferops.audit import actor_or_none


def record_event(alert: Alert, kind: str, *, actor=None, actor_name: str = "", text: str = "",
                 data: dict | None = None, at: datetime | None = None) -> AlertEvent:
    return AlertEvent.objects.create(
        alert=alert, kind=kind, at=at or timezone.now(), actor=actor_or_none(actor),
        actor_name=actor_name or getattr(actor, "username", "") or "", text=text, data=data or {})
