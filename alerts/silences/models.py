"""Silences: label matchers over a time range, as Alertmanager API v2 writes them."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Silence(models.Model):
    """Alertmanager's silence: alerts matching every matcher between the two times notify no one."""

    # [{"name", "value", "isRegex", "isEqual"}], as Alertmanager's API v2 writes them.
    matchers = models.JSONField()
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.CharField(max_length=150)
    comment = models.TextField()
    author = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="+", help_text="The user who made it (created_by is free text).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-starts_at", "-id"]
        indexes = [models.Index(fields=["ends_at"])]

    def __str__(self) -> str:
        return f"silence {self.pk}: {self.matchers} until {self.ends_at:%Y-%m-%d %H:%M}"
