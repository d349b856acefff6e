"""Console form helpers shared by every app's pages."""

from __future__ import annotations

from django.core.exceptions import ValidationError

from inferops.api import Conflict


def apply_service(form, call):
    """Run a service; put its validation errors on the form's fields. Its result, or None when it failed."""
    try:
        return call()
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            form.add_error(field if field in form.fields else None, messages)
    except Conflict as exc:
        form.add_error("name" if "name" in form.fields else None, str(exc.detail))
    return None
