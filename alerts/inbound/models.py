"""An outside alert source (a team's Alertmanager) and its token."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from inferops.validators import slug_validator


class Integration(models.Model):
    """An outside alert source (e.g. a team's Alertmanager) posting with its own bearer token."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    token_prefix = models.CharField(max_length=16, help_text="The token's first characters, to recognise it.")
    token_hash = models.CharField(max_length=64, unique=True, help_text="sha256 of the token; the token is shown once.")
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
