"""Console form helpers shared by every app's pages."""

from __future__ import annotations

from django import forms
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


def serializer_check(serializer_class, body: dict, *, refused=(), **kwargs) -> tuple[dict, dict]:
    """An API serializer's judgement of a console form's body even when some fields were refused by
    the form already (`refused`, left out of the body): (validated data of the fields it accepts,
    its errors on the others). Its errors on the refused fields are dropped: the form has said them."""
    serializer = serializer_class(data=body, **kwargs)
    if serializer.is_valid():
        return dict(serializer.validated_data), {}
    errors = {field: texts for field, texts in serializer.errors.items() if field not in refused}
    # The fields that passed, again on their own, so a service can still judge them in the same pass.
    passing = serializer_class(data={key: value for key, value in body.items() if key not in serializer.errors},
                               partial=True, **kwargs)
    return (dict(passing.validated_data) if passing.is_valid() else {}), errors


def error_lines(errors, path: str) -> list[tuple[str, str]]:
    """(path, message) for every message in DRF's nested errors: levels[1].exit_burn_rate, ..."""
    if isinstance(errors, dict):
        pairs = []
        for key, value in errors.items():
            if key == "non_field_errors":
                pairs += error_lines(value, path)
            else:
                pairs += error_lines(value, f"{path}[{key}]" if str(key).isdigit() else f"{path}.{key}")
        return pairs
    if isinstance(errors, list):
        pairs = []
        for index, item in enumerate(errors):
            pairs += [(path, str(item))] if isinstance(item, str) else error_lines(item, f"{path}[{index}]")
        return pairs
    return [(path, str(errors))]


def add_api_errors(form: forms.Form, errors: dict) -> None:
    """Put a serializer's errors on the form: under the field they concern, nested ones with their path."""
    for field, value in errors.items():
        target = field if field in form.fields else None
        for path, message in error_lines(value, field):
            form.add_error(target, message if path == field else f"{path}: {message}")
