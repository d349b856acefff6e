"""REST API for alerts from outside: integrations (admins) and the Alertmanager-compatible
receiver `POST /api/v1/alerts/alertmanager/`, authenticated by an integration's bearer token.

Point an Alertmanager at it with a `webhook_configs` entry whose `http_config.authorization`
carries the token (docs/slo.md: "Alerts from your Alertmanager").
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import authentication, exceptions, mixins, permissions, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from alerts.inbound import alertmanager as inbound
from alerts.models import Integration
from alerts.silences.api import TimeField
from inferops.api import CONFLICT, ERRORS, TOO_LARGE, ErrorSerializer, RejectUnknownFields
from inferops.roles import ADMIN
from inferops.validators import slug_validator

# Alertmanager writes this for "not set" (a firing alert's endsAt).
GO_ZERO_TIME_YEAR = 1
ALERT_STATUSES = ("firing", "resolved")


class IntegrationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Integration
        fields = ["id", "name", "token_prefix", "active", "created_at", "last_used_at"]
        read_only_fields = fields


class IntegrationCreateSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])


class IntegrationCreatedSerializer(serializers.ModelSerializer):
    token = serializers.CharField(help_text="Shown once: only its sha256 is stored.")

    class Meta:
        model = Integration
        fields = ["id", "name", "token", "token_prefix", "created_at"]
        read_only_fields = fields


@extend_schema(tags=["alerts"])
class IntegrationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = IntegrationSerializer
    queryset = Integration.objects.all()
    read_role = ADMIN
    write_role = ADMIN

    @extend_schema(request=IntegrationCreateSerializer, responses={201: IntegrationCreatedSerializer, **ERRORS,
                                                                   **CONFLICT},
                   summary="Create an integration; its bearer token is in this answer only")
    def create(self, request):
        serializer = IntegrationCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        integration, token = inbound.integration_create(name=serializer.validated_data["name"], actor=request.user)
        integration.token = token
        return Response(IntegrationCreatedSerializer(integration).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: IntegrationSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: IntegrationSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(responses={204: None, **ERRORS, 409: OpenApiResponse(ErrorSerializer,
                                                                        description="Already deactivated.")},
                   summary="Deactivate: the token stops working; its alerts keep their source")
    def destroy(self, request, *args, **kwargs):
        inbound.integration_delete(integration=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


# ---------------------------------------------------------------------------- the Alertmanager receiver


class IntegrationPrincipal:
    """request.user for a request authenticated by an integration token (no person behind it)."""

    is_authenticated = True
    is_active = True
    is_anonymous = False
    is_superuser = False
    pk = None

    def __init__(self, integration: Integration):
        self.integration = integration
        self.username = f"integration:{integration.name}"


class IntegrationTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer <integration token>`; an unknown or deactivated token is a 401."""

    def authenticate(self, request):
        parts = authentication.get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer":
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Give one token: Authorization: Bearer <integration token>.")
        integration = inbound.integration_for_token(parts[1].decode(errors="replace"))
        if integration is None:
            raise exceptions.AuthenticationFailed("Unknown integration token.")
        if not integration.active:
            raise exceptions.AuthenticationFailed(f"Integration {integration.name!r} is deactivated.")
        return IntegrationPrincipal(integration), integration

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="inferops integrations"'


class IntegrationTokenScheme(OpenApiAuthenticationExtension):
    target_class = IntegrationTokenAuthentication
    name = "integrationToken"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix="Bearer")


class IsIntegration(permissions.BasePermission):
    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Integration)


class StrictString(serializers.CharField):
    """A JSON string, never a number or a boolean turned into one."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StringMap(serializers.DictField):
    def __init__(self, **kwargs):
        super().__init__(child=StrictString(allow_blank=True, trim_whitespace=False, max_length=10_000), **kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if any(not name for name in value):
            raise serializers.ValidationError("A label or annotation name must not be empty.")
        return value


class AlertmanagerTime(TimeField):
    """RFC 3339 as Alertmanager writes it (nanoseconds allowed); Go's zero time means unset."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        return None if value.year == GO_ZERO_TIME_YEAR else value


class AlertmanagerAlertSerializer(serializers.Serializer):
    status = serializers.CharField(help_text="firing or resolved")
    labels = StringMap(allow_empty=False)
    annotations = StringMap(required=False, default=dict)
    startsAt = AlertmanagerTime(required=False, default=None)  # noqa: N815 (Alertmanager's names)
    endsAt = AlertmanagerTime(required=False, default=None)  # noqa: N815
    generatorURL = serializers.CharField(required=False, default="", allow_blank=True, max_length=1000)  # noqa: N815
    fingerprint = serializers.CharField(required=False, allow_blank=True, help_text="Alertmanager's; ignored "
                                        "(inferops fingerprints the labels itself).")

    def validate_status(self, value: str) -> str:
        if value not in ALERT_STATUSES:
            raise serializers.ValidationError(f"{value!r}: use firing or resolved.")
        return value

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        return {"status": value["status"], "labels": value["labels"], "annotations": value["annotations"],
                "starts_at": value["startsAt"], "ends_at": value["endsAt"], "generator_url": value["generatorURL"]}


class AlertmanagerPayloadSerializer(serializers.Serializer):
    """Alertmanager's webhook body, version 4. Group-level fields are read for shape only: each
    alert carries its full label set. Fields Alertmanager adds later (truncatedAlerts) are ignored."""

    version = serializers.CharField()
    status = serializers.CharField(required=False, help_text="firing or resolved (the group's)")
    receiver = serializers.CharField(required=False, allow_blank=True)
    groupKey = serializers.CharField(required=False, allow_blank=True)  # noqa: N815
    groupLabels = StringMap(required=False)  # noqa: N815
    commonLabels = StringMap(required=False)  # noqa: N815
    commonAnnotations = StringMap(required=False)  # noqa: N815
    externalURL = serializers.CharField(required=False, allow_blank=True)  # noqa: N815
    alerts = serializers.ListField(child=AlertmanagerAlertSerializer(), allow_empty=True)

    def validate_version(self, value: str) -> str:
        if value != "4":
            raise serializers.ValidationError(f"Version {value!r} is not supported: Alertmanager's webhook "
                                              f"payload version 4 is.")
        return value


class IngestCountsSerializer(serializers.Serializer):
    opened = serializers.IntegerField()
    updated = serializers.IntegerField()
    resolved = serializers.IntegerField()


@extend_schema(tags=["alerts"])
class AlertmanagerReceiver(APIView):
    authentication_classes = [IntegrationTokenAuthentication]
    permission_classes = [IsIntegration]

    @extend_schema(request=AlertmanagerPayloadSerializer,
                   responses={200: IngestCountsSerializer, 400: ERRORS[400], 401: ERRORS[401], **TOO_LARGE},
                   summary="Alertmanager's webhook (payload version 4), with an integration's bearer token",
                   description="Firing alerts open or update the open alert of their label set (deduplicated by "
                               "inferops' fingerprint of the labels); resolved ones resolve it. Label `severity` "
                               "page, critical or error pages; any other value opens a ticket. All or nothing.")
    def post(self, request):
        if not isinstance(request.data, dict):
            raise serializers.ValidationError({"detail": "Expected a JSON object: Alertmanager's webhook payload."})
        serializer = AlertmanagerPayloadSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        counts = inbound.alertmanager_ingest(integration=request.auth, alerts=serializer.validated_data["alerts"],
                                             now=timezone.now())
        return Response(counts.as_dict())
