from django.contrib import admin

from alerts.models import Alert, Delivery, Notification, Receiver


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ["starts_at", "slo", "severity", "status", "ends_at", "fingerprint"]
    list_filter = ["status", "severity"]


@admin.register(Receiver)
class ReceiverAdmin(admin.ModelAdmin):
    list_display = ["name", "url", "active", "send_resolved", "updated_at"]


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ["created_at", "alert", "receiver", "alert_status", "status", "attempts"]
    list_filter = ["status"]


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ["created_at", "notification", "attempt", "outcome", "http_status"]
    list_filter = ["outcome"]
