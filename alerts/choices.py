from django.db import models


class Severity(models.TextChoices):
    PAGE = "page", "Page"
    TICKET = "ticket", "Ticket"


class AlertStatus(models.TextChoices):
    FIRING = "firing", "Firing"
    RESOLVED = "resolved", "Resolved"


class NotificationStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SENDING = "sending", "Sending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"


class DeliveryOutcome(models.TextChoices):
    OK = "ok", "Delivered"
    TEMPORARY_ERROR = "temporary-error", "Temporary error (retried)"
    PERMANENT_ERROR = "permanent-error", "Permanent error"
