"""Shared pieces of the REST API: the error handler and schema, the OpenAPI error responses every
endpoint names, query-parameter readers that answer bad values as 400s on the field, and the
audit log's endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, generics, serializers
from rest_framework.metadata import SimpleMetadata
from rest_framework.views import exception_handler as drf_exception_handler

from inferops.models import AuditEvent
from inferops.roles import ADMIN
from inferops.timeparse import parse_duration, parse_time


class Conflict(exceptions.APIException):
    status_code = 409
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class ErrorSerializer(serializers.Serializer):
    """DRF's error shape: `detail` for request-level errors, or one list of messages per field."""

    detail = serializers.CharField(required=False)


ERRORS = {
    400: OpenApiResponse(ErrorSerializer, description="Invalid input; each field names its reason."),
    401: OpenApiResponse(ErrorSerializer, description="No or bad credentials."),
    403: OpenApiResponse(ErrorSerializer, description="Your role does not allow this."),
    404: OpenApiResponse(ErrorSerializer, description="Unknown object; the message names it."),
}
CONFLICT = {409: OpenApiResponse(ErrorSerializer, description="Already exists.")}
TOO_LARGE = {413: OpenApiResponse(ErrorSerializer, description="Request body too large.")}
MIN_STEP_S = 15


class RejectUnknownFields:
    """Serializer mixin: a misspelt field (`rpm` for `rpm_limit`) is a 400 naming it, not ignored,
    in nested serializers too."""

    def to_internal_value(self, data):
        unknown = {key: ["Unknown field."] for key in sorted(set(data) - set(self.fields))} if isinstance(
            data, Mapping) else {}
        try:
            attrs = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if unknown and isinstance(exc.detail, dict):
                exc.detail.update(serializers.ValidationError(unknown).detail)
            raise
        if unknown:
            raise serializers.ValidationError(unknown)
        return attrs


class PlainMetadata(SimpleMetadata):
    """OPTIONS as a plain APIView answers it: no `actions`, which a ViewSet would read from its
    serializer_class (not what an action like ack takes, and a 500 where a ViewSet has none)."""

    def determine_actions(self, request, view):
        return {}


def query_time(value: str | None, field: str, default: datetime) -> datetime:
    """A time query parameter (ISO 8601 or Unix seconds); default when absent."""
    if not value:
        return default
    try:
        return parse_time(value, field)
    except ValueError as exc:
        raise serializers.ValidationError({field: [str(exc).removeprefix(f"{field}: ")]}) from None


def query_step(value: str | None, default_s: int = 60) -> int:
    """A series' step in whole seconds (`30`, `30s`, `5m`, `1h`), at least MIN_STEP_S."""
    if not value:
        return default_s
    try:
        seconds = int(parse_duration(value, "step"))
    except ValueError as exc:
        raise serializers.ValidationError({"step": [str(exc).removeprefix("step: ")]}) from None
    if seconds < MIN_STEP_S:
        raise serializers.ValidationError({"step": [f"step must be at least {MIN_STEP_S} seconds."]})
    return seconds


def exception_handler(exc, context):
    # Model.clean() raises Django's ValidationError; answer it as DRF would a serializer error.
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = exceptions.ValidationError(detail)
    return drf_exception_handler(exc, context)


class AuditEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = ["id", "actor_name", "action", "object_type", "object_id", "object_repr",
                  "before", "after", "created_at"]


@extend_schema(tags=["audit"])
class AuditList(generics.ListAPIView):
    serializer_class = AuditEventSerializer
    read_role = ADMIN

    @extend_schema(parameters=[
        OpenApiParameter("action", OpenApiTypes.STR, description="e.g. version.register"),
        OpenApiParameter("object_type", OpenApiTypes.STR, description="e.g. registry.modelversion"),
        OpenApiParameter("actor", OpenApiTypes.STR, description="username"),
    ], responses={200: AuditEventSerializer(many=True), **ERRORS})
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        queryset = AuditEvent.objects.all()
        params = self.request.query_params
        for param, field in (("action", "action"), ("object_type", "object_type"), ("actor", "actor_name")):
            if value := params.get(param):
                queryset = queryset.filter(**{field: value})
        return queryset
