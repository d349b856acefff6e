from django.db import models


class Severity(models.TextChoices):
    PAGE = "page", "Page"
    TICKET = "ticket", "Ticket"


class AlertStatus(models.TextChoices):
    FIRING = "firing", "Firing"
    ACKNOWLEDGED = "acknowledged", "Acknowledged"
    RESOLVED = "resolved", "Resolved"


# Not resolved yet: someone may have it (acknowledged), but the problem is still there.
OPEN_STATUSES = (AlertStatus.FIRING, AlertStatus.ACKNOWLEDGED)


class EventKind(models.TextChoices):
    """What an alert's timeline records."""

    OPENED = "opened", "Opened"
    ACKNOWLEDGED = "acknowledged", "Acknowledged"
    UNACKNOWLEDGED = "unacknowledged", "Acknowledgement withdrawn"
    SNOOZED = "snoozed", "Snoozed"
    RESOLVED = "resolved", "Resolved"
    COMMENT = "comment", "Comment"
    NOTIFIED = "notified", "Notification sent"
    NOTIFY_FAILED = "notify-failed", "Notification failed"
    MUTED = "muted", "Muted (silence or inhibition)"


class ReceiverKind(models.TextChoices):
    WEBHOOK = "webhook", "Webhook (Alertmanager v4 payload)"
    PAGERDUTY = "pagerduty", "PagerDuty Events API v2"
    SLACK = "slack", "Slack-compatible incoming webhook"
    EMAIL = "email", "Email (SMTP)"


class IncidentPer(models.TextChoices):
    """What one PagerDuty incident stands for."""

    GROUP = "group", "One incident per notification group"
    ALERT = "alert", "One incident per alert"


class NotificationStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SENDING = "sending", "Sending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"


class DeliveryOutcome(models.TextChoices):
    OK = "ok", "Delivered"
    TEMPORARY_ERROR = "temporary-error", "Temporary error (retried)"
    PERMANENT_ERROR = "permanent-error", "Permanent error"


class MatchOp(models.TextChoices):
    """A route matcher's operator, as Alertmanager writes them."""

    EQUAL = "=", "equals"
    NOT_EQUAL = "!=", "does not equal"
    REGEX = "=~", "matches the regex"
    NOT_REGEX = "!~", "does not match the regex"


class Rotation(models.TextChoices):
    DAILY = "daily", "Daily hand-off"
    WEEKLY = "weekly", "Weekly hand-off"
