"""Validators every app's names share."""

from django.core.validators import RegexValidator

# A DNS label: names end up in URLs, Redis keys, Kubernetes object names and Prometheus labels.
slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$",
    "Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit.",
)
