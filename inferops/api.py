"""Shared pieces of the REST API: the error handler and schema, the OpenAPI error responses every
endpoint names, query-parameter readers that answer bad values as 400s on the field, and the
audit log's endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import URLValidator
from django.db import DataError, connection, transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from psycopg.errors import NumericValueOutOfRange
from rest_framework import exceptions, generics, renderers, serializers
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
BIGINT_MAX = 2**63 - 1
NUL_REFUSED = "Null characters are not allowed."  # what DRF's CharField says


@extend_schema_field({"type": "string", "anyOf": [{"format": "uri"}, {"maxLength": 0}]})
class UrlOrBlankField(serializers.URLField):
    """A URL the model lets be blank, as an answer shows it: the schema says "a URL or empty", where a
    URLField's `format: uri` would call "" invalid. Read-only: it validates nothing."""

    def __init__(self, **kwargs):
        super().__init__(read_only=True, **kwargs)
        # drf-spectacular reads `format: uri` off the URLValidator too.
        self.validators = [v for v in self.validators if not isinstance(v, URLValidator)]


class AuthenticateBeforeFormat:
    """View mixin for the views that answer in several formats (`?format=csv`). DRF negotiates the format
    before it authenticates: a stranger asking for an unknown format got a 404, not a 401, and anyone a bare
    404 rather than a 400 naming the field. And an error is JSON, as the schema says, whatever was asked."""

    def initial(self, request, *args, **kwargs):
        self.perform_authentication(request)
        self.check_permissions(request)
        formats = [renderer.format for renderer in self.get_renderers()]
        if request.query_params.get("format", formats[0]) not in formats:
            named = ", ".join(name for name in formats if name != "api")  # "api": the browsable renderer's
            raise serializers.ValidationError({"format": [f"One of: {named}."]})
        super().initial(request, *args, **kwargs)

    def handle_exception(self, exc):
        self.request.accepted_renderer, self.request.accepted_media_type = renderers.JSONRenderer(), "application/json"
        return super().handle_exception(exc)


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
        # In UTC: the same instant, and Postgres refuses offsets past 15:59 that Python takes (`-16:02`).
        return parse_time(value, field).astimezone(UTC)
    except ValueError as exc:
        raise serializers.ValidationError({field: [str(exc).removeprefix(f"{field}: ")]}) from None
    except OverflowError:
        raise serializers.ValidationError({field: [f"{value!r} is out of range."]}) from None


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
    # A number past Postgres's bigint (`?limit=10**30` reaches the pagination's LIMIT) is bad input, not a 500.
    if isinstance(exc, DataError) and isinstance(exc.__cause__, NumericValueOutOfRange):
        if connection.in_atomic_block:  # Postgres has aborted the transaction: it can only roll back
            transaction.set_rollback(True)
        exc = exceptions.ValidationError(_out_of_range(context["request"].query_params))
    # A NUL in a filter or a name looked up (psycopg refuses it before Postgres sees it): bad input too.
    if isinstance(exc, DataError) and "NUL (0x00)" in str(exc.__cause__):
        exc = exceptions.ValidationError(_with_nul(context["request"]))
    return drf_exception_handler(exc, context)


def _with_nul(request) -> dict[str, list[str]]:
    """The query parameters and body fields holding a NUL character, each with DRF's reason; else a `detail`."""

    def holds_nul(value) -> bool:
        if isinstance(value, str):
            return "\x00" in value
        if isinstance(value, Mapping):
            return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
        return isinstance(value, list | tuple) and any(holds_nul(item) for item in value)

    fields = [(name, values) for name, values in request.query_params.lists()]
    if isinstance(data := request.data, Mapping):
        fields += list(data.items())
    refused = {str(name): [NUL_REFUSED] for name, value in fields if holds_nul(name) or holds_nul(value)}
    return refused or {"detail": NUL_REFUSED}


def _out_of_range(params) -> dict[str, list[str]]:
    """The query parameters whose numbers no bigint holds, each with its reason; else a `detail`."""
    too_large = {}
    for name, value in params.items():
        try:
            number = int(value)
        except ValueError:
            continue
        if abs(number) > BIGINT_MAX:
            too_large[name] = [f"Ensure this value is less than or equal to {BIGINT_MAX}."]
    return too_large or {"detail": "A number in the request is out of range."}


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
