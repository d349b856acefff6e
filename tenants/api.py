"""REST API: tenants, their API keys (created with the secret shown once, revoked), and usage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Count, DateTimeField, DurationField, F, Func, Q, Sum, Value
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from inferops.api import CONFLICT, ERRORS, TOO_LARGE, RejectUnknownFields, query_step, query_time
from inferops.validators import slug_validator
from tenants import services
from tenants.models import PRIORITY_RANGE, ApiKey, Tenant, UsageMinute

INT4_MAX = 2**31 - 1
# The batch_* counters are the offline batches' share of the others (their own series in the charts).
USAGE_COUNTERS = ["requests", "errors", "client_errors", "prompt_tokens", "completion_tokens", "batch_requests",
                  "batch_errors", "batch_prompt_tokens", "batch_completion_tokens"]
USAGE_GROUPS = ["tenant", "key_prefix", "deployment", "version"]
MAX_BUCKETS = 5000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def limit_field(help_text: str) -> serializers.IntegerField:
    return serializers.IntegerField(min_value=1, max_value=INT4_MAX, allow_null=True, required=False,
                                    help_text=f"{help_text}; null = unlimited.")


class TenantSerializer(serializers.ModelSerializer):
    active_keys = serializers.IntegerField(read_only=True, help_text="Keys neither revoked nor expired.")

    class Meta:
        model = Tenant
        fields = ["name", "display_name", "rpm_limit", "tpm_limit", "max_concurrent", "active_keys",
                  "created_at", "updated_at"]
        read_only_fields = fields


class TenantLimitsSerializer(RejectUnknownFields, serializers.Serializer):
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    rpm_limit = limit_field("Requests per minute over all the tenant's keys")
    tpm_limit = limit_field("Tokens (prompt + completion) per minute over all the tenant's keys")
    max_concurrent = limit_field("Requests in flight at once over all the tenant's keys")


class TenantCreateSerializer(TenantLimitsSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])


class ApiKeySerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name", read_only=True)
    state = serializers.CharField(read_only=True, help_text="active, expired or revoked")
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)

    class Meta:
        model = ApiKey
        fields = ["prefix", "name", "tenant", "deployments", "rpm_limit", "tpm_limit", "max_concurrent",
                  "priority", "expires_at", "revoked_at", "state", "created_by", "created_at"]
        read_only_fields = fields


class ApiKeyCreateSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=100)
    deployments = serializers.ListField(
        child=serializers.CharField(max_length=63, validators=[slug_validator]), required=False, default=list,
        max_length=200, help_text="Deployment names the key may call; empty = every deployment.")
    rpm_limit = limit_field("Requests per minute for this key")
    tpm_limit = limit_field("Tokens (prompt + completion) per minute for this key")
    max_concurrent = limit_field("Requests in flight at once for this key")
    priority = serializers.IntegerField(min_value=PRIORITY_RANGE[0], max_value=PRIORITY_RANGE[1], default=0,
                                        help_text="Higher is more important; degradation sheds the lowest first.")
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The secret key. Shown once: it is stored only as a hash.")

    class Meta(ApiKeySerializer.Meta):
        fields = ["key", *ApiKeySerializer.Meta.fields]
        read_only_fields = fields


def tenant_queryset():
    now = timezone.now()
    active = Q(keys__revoked_at__isnull=True) & (Q(keys__expires_at__isnull=True) | Q(keys__expires_at__gt=now))
    return Tenant.objects.annotate(active_keys=Count("keys", filter=active))


def get_tenant(name: str) -> Tenant:
    return get_object_or_404(tenant_queryset(), name=name)


def get_key(tenant: Tenant, prefix: str) -> ApiKey:
    return get_object_or_404(ApiKey.objects.select_related("tenant", "created_by"), tenant=tenant, prefix=prefix)


@extend_schema(tags=["tenants"])
class TenantViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = TenantSerializer
    lookup_field = "name"

    def get_queryset(self):
        return tenant_queryset()

    @extend_schema(responses={200: TenantSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=TenantCreateSerializer, responses={201: TenantSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request):
        serializer = TenantCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        tenant = services.tenant_create(actor=request.user, **serializer.validated_data)
        return Response(TenantSerializer(get_tenant(tenant.name)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: TenantSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=TenantLimitsSerializer, responses={200: TenantSerializer, **ERRORS},
                   description="Change the display name or limits; keys pick up new limits within seconds.")
    def partial_update(self, request, name: str):
        tenant = self.get_object()
        serializer = TenantLimitsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.tenant_update(tenant=tenant, actor=request.user, **serializer.validated_data)
        return Response(TenantSerializer(get_tenant(name)).data)


@extend_schema(tags=["tenants"])
class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ApiKeySerializer
    lookup_field = "prefix"

    def get_queryset(self):
        return ApiKey.objects.filter(tenant=get_tenant(self.kwargs["name"])).select_related("tenant", "created_by")

    @extend_schema(responses={200: ApiKeySerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer, **ERRORS, **TOO_LARGE},
                   description="Create a key. The answer's `key` is the only time the secret is shown.")
    def create(self, request, name: str):
        tenant = get_tenant(name)
        serializer = ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key, secret = services.key_create(tenant=tenant, actor=request.user, **serializer.validated_data)
        body = ApiKeyCreatedSerializer(key).data
        body["key"] = secret
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: ApiKeySerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(responses={204: None, **ERRORS},
                   description="Revoke the key: every gateway refuses it within 5 s. Revoking twice is harmless.")
    def destroy(self, request, *args, **kwargs):
        services.key_revoke(key=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class DateBin(Func):
    """Postgres date_bin(stride, source, origin): the start of the step-long bucket holding source."""

    function = "date_bin"
    output_field = DateTimeField()


def usage_filters(params) -> dict:
    """The usage query's optional filters, each checked; raises a 400 naming the bad one."""
    filters, errors = {}, {}
    if tenant := params.get("tenant"):
        if not Tenant.objects.filter(name=tenant).exists():
            errors["tenant"] = [f"No tenant named {tenant!r}."]
        filters["tenant"] = tenant
    if deployment := params.get("deployment"):
        try:
            slug_validator(deployment)
        except DjangoValidationError as exc:
            errors["deployment"] = list(exc.messages)
        filters["deployment"] = deployment
    if prefix := params.get("key_prefix"):
        filters["key_prefix"] = prefix
    if (version := params.get("version")) is not None:
        if not version.isdigit():
            errors["version"] = ["Must be a version number."]
        else:
            filters["version"] = int(version)
    if errors:
        raise serializers.ValidationError(errors)
    return filters


def usage_window(params) -> tuple[datetime, datetime, int]:
    step = query_step(params.get("step"), default_s=3600)
    if step % 60:
        raise serializers.ValidationError({"step": ["Must be a whole number of minutes: the ledger is per minute."]})
    end = query_time(params.get("end"), "end", timezone.now())
    start = query_time(params.get("start"), "start", end - timedelta(days=1))
    if start >= end:
        raise serializers.ValidationError({"start": ["start must be before end."]})
    # Buckets align to the epoch, so an hour bucket is a clock hour; the first one starts at or before `start`.
    start = EPOCH + timedelta(seconds=(start - EPOCH).total_seconds() // step * step)
    if (end - start).total_seconds() / step > MAX_BUCKETS:
        raise serializers.ValidationError({"step": [f"More than {MAX_BUCKETS} buckets; use a larger step."]})
    return start, end, step


def usage_report(*, start: datetime, end: datetime, step: int, **filters) -> dict:
    """Ledger rows summed per step bucket × tenant × key × deployment × version, and in total."""
    rows = UsageMinute.objects.filter(minute__gte=start, minute__lt=end, **filters)
    bucket = DateBin(Value(timedelta(seconds=step), output_field=DurationField()), F("minute"),
                     Value(EPOCH, output_field=DateTimeField()))
    sums = {counter: Sum(counter) for counter in USAGE_COUNTERS}
    grouped = (rows.annotate(start=bucket).values("start", *USAGE_GROUPS).annotate(**sums)
               .order_by("start", *USAGE_GROUPS))
    totals = rows.aggregate(**sums)
    return {
        "start": start, "end": end, "step": step,
        "results": list(grouped),
        "totals": {counter: totals[counter] or 0 for counter in USAGE_COUNTERS},
    }


COUNTER_FIELDS = {counter: serializers.IntegerField() for counter in USAGE_COUNTERS}


@extend_schema(tags=["usage"])
class Usage(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("tenant", OpenApiTypes.STR),
            OpenApiParameter("deployment", OpenApiTypes.STR),
            OpenApiParameter("key_prefix", OpenApiTypes.STR),
            OpenApiParameter("version", OpenApiTypes.INT),
            OpenApiParameter("start", OpenApiTypes.STR, description="ISO 8601 or Unix time; default end - 1 day"),
            OpenApiParameter("end", OpenApiTypes.STR, description="ISO 8601 or Unix time; default now"),
            OpenApiParameter("step", OpenApiTypes.STR, description="whole minutes: 60, 5m, 1h, 1d; default 1h"),
        ],
        responses={200: inline_serializer("UsageReport", {
            "start": serializers.DateTimeField(), "end": serializers.DateTimeField(),
            "step": serializers.IntegerField(),
            "results": inline_serializer("UsageBucket", {
                "start": serializers.DateTimeField(), "tenant": serializers.CharField(allow_null=True),
                "key_prefix": serializers.CharField(allow_null=True),
                "deployment": serializers.CharField(allow_null=True),
                "version": serializers.IntegerField(allow_null=True), **COUNTER_FIELDS,
            }, many=True),
            "totals": inline_serializer("UsageTotals", COUNTER_FIELDS),
        }), **ERRORS},
        description="Usage from the per-minute ledger, summed per step. Rows with a null tenant are "
                    "requests refused before a key was known (401). The batch_* counters are the part of "
                    "requests, errors and tokens that lines of offline batches (/v1/batches) made.",
    )
    def get(self, request):
        filters = usage_filters(request.query_params)
        start, end, step = usage_window(request.query_params)
        return Response(usage_report(start=start, end=end, step=step, **filters))
