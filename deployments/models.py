from django.conf import settings
from django.db import models

from deployments.choices import Backend, DeploymentStatus, DriverName
from registry.models import ModelVersion, RegisteredModel, slug_validator


class Deployment(models.Model):
    """What serves a route: a pinned model version on N replicas behind `name`."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    model = models.ForeignKey(RegisteredModel, on_delete=models.PROTECT, related_name="deployments")
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="deployments")
    # The alias the version was resolved from, if any; the version stays pinned until updated.
    alias = models.CharField(max_length=63, blank=True)
    backend = models.CharField(max_length=16, choices=Backend.choices, default=Backend.BUILTIN)
    driver = models.CharField(max_length=16, choices=DriverName.choices, default=DriverName.LOCAL)
    engine_args = models.JSONField(default=dict, blank=True)
    replicas = models.PositiveIntegerField(default=1)
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1)
    autoscale = models.BooleanField(default=False)
    resources = models.JSONField(default=dict, blank=True)
    paused = models.BooleanField(default=False, help_text="Reconciliation paused by an operator.")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
