from django import forms
from django.contrib import admin

from alerts import services
from alerts.models import Alert, Delivery, Notification, Receiver
from inferops.admin import ServiceAdmin


@admin.register(Alert)
class AlertAdmin(ServiceAdmin):
    """Read-only: alerts are opened and resolved by evaluation."""

    list_display = ["starts_at", "slo", "severity", "status", "ends_at", "fingerprint"]
    list_filter = ["status", "severity"]


@admin.register(Receiver)
class ReceiverAdmin(ServiceAdmin):
    list_display = ["name", "kind", "url", "active", "send_resolved", "failing_since", "updated_at"]
    list_filter = ["kind", "active"]

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        if db_field.name == "routing_key":  # write-only here too: never rendered back
            kwargs["widget"] = forms.PasswordInput(render_value=False)
            kwargs["help_text"] = "PagerDuty's integration key. Write-only: leave blank to keep the stored one."
        if db_field.name == "url":
            kwargs["assume_scheme"] = "https"
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def create_object(self, request, fields):
        return services.receiver_save(instance=None, fields=fields, actor=request.user)

    def update_object(self, request, obj, fields):
        if not fields.get("routing_key", True):
            fields.pop("routing_key")  # blank: the form never shows the key, so keep it
        return services.receiver_save(instance=obj, fields=fields, actor=request.user)

    def delete_object(self, request, obj):
        services.receiver_delete(receiver=obj, actor=request.user)


@admin.register(Notification)
class NotificationAdmin(ServiceAdmin):
    """Read-only: one row per notification, written by the delivery task."""

    list_display = ["created_at", "alert", "receiver", "alert_status", "status", "attempts"]
    list_filter = ["status"]


@admin.register(Delivery)
class DeliveryAdmin(ServiceAdmin):
    """Read-only: one row per delivery attempt."""

    list_display = ["created_at", "notification", "attempt", "outcome", "http_status"]
    list_filter = ["outcome"]
