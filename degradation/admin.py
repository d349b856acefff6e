"""Read-only admin pages: policies and overrides change through the API or the console, whose
services validate, audit and put the level's actions in force."""

from django.contrib import admin

from degradation.models import DegradationPolicy, DegradationState, LevelChange
from inferops.admin import ServiceAdmin


class ReadOnlyAdmin(ServiceAdmin):
    """No service named: no add, change or delete."""


@admin.register(DegradationPolicy)
class DegradationPolicyAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "enabled", "window_minutes", "hold_s", "updated_at"]


@admin.register(DegradationState)
class DegradationStateAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "level", "since", "override_level", "override_until", "evaluated_at"]


@admin.register(LevelChange)
class LevelChangeAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "at", "from_level", "to_level", "reason", "actor"]
    list_filter = ["deployment"]
