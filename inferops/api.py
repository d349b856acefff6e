"""Shared pieces of the REST API: the error handler and the error schema."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, serializers
from rest_framework.views import exception_handler as drf_exception_handler


class Conflict(exceptions.APIException):
    status_code = 409
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class ErrorSerializer(serializers.Serializer):
    """DRF's error shape: `detail` for request-level errors, or one list of messages per field."""

    detail = serializers.CharField(required=False)


def exception_handler(exc, context):
    # Model.clean() raises Django's ValidationError; answer it as DRF would a serializer error.
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = exceptions.ValidationError(detail)
    return drf_exception_handler(exc, context)
