"""Validators every app's names share, and the collector that reports every refusal at once."""

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import RegexValidator

# A DNS label: names end up in URLs, Redis keys, Kubernetes object names and Prometheus labels.
slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$",
    "Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit.",
)


class Problems:
    """Every check's refusal gathered in one pass, so a form or an API call names all its problems at
    once rather than the first one per submit."""

    def __init__(self):
        self.errors: dict[str, list[str]] = {}

    def check(self, call, *args, **kwargs):
        """call(*args, **kwargs), or None when it raised a ValidationError (its messages kept)."""
        try:
            return call(*args, **kwargs)
        except ValidationError as exc:
            self.add(exc)
            return None

    def add(self, exc: ValidationError) -> None:
        found = exc.message_dict if hasattr(exc, "error_dict") else {NON_FIELD_ERRORS: exc.messages}
        for field, messages in found.items():
            kept = self.errors.setdefault(field, [])
            kept += [message for message in messages if message not in kept]

    def raise_any(self) -> None:
        if self.errors:
            raise ValidationError(self.errors)
