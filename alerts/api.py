"""REST API for alerts (read by anyone with a role) and webhook receivers (admins only)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from alerts import services
from alerts.choices import AlertStatus, IncidentPer, ReceiverKind, Severity
from alerts.models import Alert, AlertEvent, Delivery, Receiver
from alerts.receivers.kinds import PAGERDUTY_EVENTS_URL
from inferops.api import (
    CONFLICT,
    ERRORS,
    Conflict,
    ErrorSerializer,
    PlainMetadata,
    RejectUnknownFields,
    UrlOrBlankField,
)
from inferops.roles import ADMIN
from inferops.validators import slug_validator

ALERT_CONFLICT = {409: OpenApiResponse(ErrorSerializer, description="The alert is already resolved.")}


class AlertSerializer(serializers.ModelSerializer):
    slo = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    integration = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True,
                                               help_text="The integration that posted it; null: the platform.")
    acknowledged_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    resolved_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    generator_url = UrlOrBlankField()

    class Meta:
        model = Alert
        fields = ["id", "fingerprint", "slo", "integration", "severity", "status", "starts_at", "ends_at", "updated_at",
                  "acknowledged_at", "acknowledged_by", "snoozed_until", "resolved_by", "labels", "annotations",
                  "generator_url"]
        read_only_fields = fields


class AlertEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertEvent
        fields = ["id", "at", "kind", "actor_name", "text", "data"]
        read_only_fields = fields


class StrictSerializer(RejectUnknownFields, serializers.Serializer):
    pass


class SnoozeSerializer(StrictSerializer):
    minutes = serializers.IntegerField(min_value=1, max_value=7 * 24 * 60, help_text="1 minute to 7 days.")


class CommentSerializer(StrictSerializer):
    text = serializers.CharField(max_length=5000)


class EmptySerializer(StrictSerializer):
    pass


# The kind-specific fields each kind may have, the one it needs, and their empty values.
RECEIVER_FIELDS = {ReceiverKind.WEBHOOK: {"url"}, ReceiverKind.SLACK: {"url"},
                   ReceiverKind.PAGERDUTY: {"url", "routing_key", "incident_per"}, ReceiverKind.EMAIL: {"to"}}
RECEIVER_NEEDS = {ReceiverKind.WEBHOOK: ("url", "the URL to POST to"),
                  ReceiverKind.SLACK: ("url", "its incoming webhook URL"),
                  ReceiverKind.PAGERDUTY: ("routing_key", "its integration key"),
                  ReceiverKind.EMAIL: ("to", "at least one address")}
# incident_per's blank is what the other kinds do anyway: one message per group.
RECEIVER_BLANK = {"url": "", "routing_key": "", "to": [], "incident_per": IncidentPer.GROUP}


class ReceiverSerializer(RejectUnknownFields, serializers.ModelSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    kind = serializers.ChoiceField(choices=ReceiverKind.choices, default=ReceiverKind.WEBHOOK)
    url = serializers.URLField(max_length=500, required=False, allow_blank=True,
                               help_text="webhook and slack: where to POST; pagerduty: the Events API v2 URL "
                                         f"(default {PAGERDUTY_EVENTS_URL}).")
    routing_key = serializers.CharField(max_length=200, required=False, allow_blank=True, write_only=True,
                                        help_text="pagerduty: the integration key. Write-only.")
    routing_key_set = serializers.SerializerMethodField(help_text="Whether a routing_key is stored.")
    to = serializers.ListField(child=serializers.EmailField(max_length=254), required=False, max_length=50,
                               help_text="email: the addresses to send to.")
    incident_per = serializers.ChoiceField(
        choices=IncidentPer.choices, required=False,
        help_text="pagerduty: `group` (default) opens one incident per notification group, as Alertmanager's "
                  "integration does; `alert` one per alert. Other kinds send one message per group.")

    class Meta:
        model = Receiver
        fields = ["id", "name", "kind", "url", "routing_key", "routing_key_set", "to", "incident_per", "send_resolved",
                  "active", "failing_since", "last_error", "created_at", "updated_at"]
        read_only_fields = ["id", "failing_since", "last_error", "created_at", "updated_at"]

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_routing_key_set(self, receiver: Receiver) -> bool:
        return bool(receiver.routing_key)

    def validate_to(self, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    def validate(self, attrs):
        instance = self.instance
        kind = attrs.get("kind", instance.kind if instance else ReceiverKind.WEBHOOK)
        if instance is not None and kind != instance.kind:
            # A new kind drops what only the old one used, unless given again.
            attrs = {**{f: v for f, v in RECEIVER_BLANK.items() if f not in RECEIVER_FIELDS[kind]}, **attrs}
        errors = {name: [f"{kind} receivers have no {name}."]
                  for name in sorted(set(RECEIVER_BLANK) - RECEIVER_FIELDS[kind])
                  if name in attrs and attrs[name] != RECEIVER_BLANK[name]}
        name, what = RECEIVER_NEEDS[kind]
        if not (attrs[name] if name in attrs else getattr(instance, name, None)):
            errors[name] = [f"{kind} receivers need {name}: {what}."]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class DeliverySerializer(serializers.ModelSerializer):
    alert = serializers.IntegerField(source="notification.alert_id")
    alert_status = serializers.CharField(source="notification.alert_status")
    notification_status = serializers.CharField(source="notification.status")

    class Meta:
        model = Delivery
        fields = ["id", "alert", "alert_status", "notification_status", "attempt", "outcome", "http_status", "error",
                  "duration_ms", "created_at"]
        read_only_fields = fields


@extend_schema(tags=["alerts"])
class AlertViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Alerts are read here and changed only by their actions: ack, resolve, snooze, comment.
    serializer_class = AlertSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered

    def get_queryset(self):
        if self.action != "list":
            return Alert.objects.select_related("slo", "integration")
        queryset = Alert.objects.select_related("slo")
        params = self.request.query_params
        for name, choices in (("status", AlertStatus.values), ("severity", Severity.values)):
            if value := params.get(name):
                if value not in choices:
                    raise serializers.ValidationError({name: [f"{value!r}: use one of {', '.join(choices)}."]})
                queryset = queryset.filter(**{name: value})
        if slo := params.get("slo"):
            queryset = queryset.filter(slo__name=slo)
        return queryset

    @extend_schema(parameters=[OpenApiParameter("status", OpenApiTypes.STR, enum=AlertStatus.values),
                               OpenApiParameter("severity", OpenApiTypes.STR, enum=Severity.values),
                               OpenApiParameter("slo", OpenApiTypes.STR, description="SLO name.")],
                   responses={200: AlertSerializer(many=True), **ERRORS},
                   description="Alerts, newest first.")
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: AlertSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=EmptySerializer, responses={200: AlertSerializer, **ERRORS, **ALERT_CONFLICT},
                   summary="Acknowledge: someone has it (escalation stops; PagerDuty and Slack hear so)")
    @action(detail=True, methods=["post"])
    def ack(self, request, pk: int):
        return _open_alert_action(request, pk, EmptySerializer,
                                  lambda alert: services.alert_acknowledge(alert=alert, actor=request.user))

    @extend_schema(request=EmptySerializer, responses={200: AlertSerializer, **ERRORS, **ALERT_CONFLICT},
                   summary="Resolve by hand (receivers that heard of it hear the resolution)")
    @action(detail=True, methods=["post"])
    def resolve(self, request, pk: int):
        def resolve(alert):
            if not alert.is_open:
                raise Conflict(f"Alert {alert.pk} is already resolved.")
            services.alert_resolve(alert=alert, now=timezone.now(), actor=request.user)
        return _open_alert_action(request, pk, EmptySerializer, resolve)

    @extend_schema(request=SnoozeSerializer, responses={200: AlertSerializer, **ERRORS, **ALERT_CONFLICT},
                   summary="Notify no one about it for some minutes")
    @action(detail=True, methods=["post"])
    def snooze(self, request, pk: int):
        return _open_alert_action(request, pk, SnoozeSerializer, lambda alert, minutes: services.alert_snooze(
            alert=alert, actor=request.user, minutes=minutes))

    @extend_schema(responses={200: AlertEventSerializer(many=True), **ERRORS},
                   summary="The alert's timeline: state changes, notifications and comments, oldest first")
    @action(detail=True, methods=["get"])
    def comments(self, request, pk: int):
        alert = get_object_or_404(Alert, pk=pk)
        return Response(AlertEventSerializer(alert.events.all(), many=True).data)

    @extend_schema(request=CommentSerializer, responses={201: AlertEventSerializer, **ERRORS},
                   summary="Add a comment to the alert's timeline")
    @comments.mapping.post
    def comment(self, request, pk: int):
        alert = get_object_or_404(Alert, pk=pk)
        serializer = CommentSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        event = services.alert_comment(alert=alert, actor=request.user, text=serializer.validated_data["text"])
        return Response(AlertEventSerializer(event).data, status=status.HTTP_201_CREATED)


def _open_alert_action(request, pk: int, serializer_class, act):
    alert = get_object_or_404(Alert, pk=pk)
    serializer = serializer_class(data=request.data or {})
    serializer.is_valid(raise_exception=True)
    act(alert, **serializer.validated_data)
    return Response(AlertSerializer(Alert.objects.select_related("slo", "integration").get(pk=pk)).data)


@extend_schema(tags=["alerts"])
class ReceiverViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Receivers hold secrets (URLs, routing keys): admins only, to read too.
    serializer_class = ReceiverSerializer
    queryset = Receiver.objects.all()
    read_role = ADMIN
    write_role = ADMIN

    @extend_schema(request=ReceiverSerializer, responses={201: ReceiverSerializer, **ERRORS, **CONFLICT})
    def create(self, request):
        serializer = ReceiverSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        receiver = services.receiver_save(instance=None, fields=serializer.validated_data, actor=request.user)
        return Response(ReceiverSerializer(receiver).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: ReceiverSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: ReceiverSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=ReceiverSerializer, responses={200: ReceiverSerializer, **ERRORS, **CONFLICT})
    def partial_update(self, request, pk: int):
        receiver = self.get_object()
        serializer = ReceiverSerializer(receiver, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        saved = services.receiver_save(instance=receiver, fields=serializer.validated_data, actor=request.user)
        return Response(ReceiverSerializer(saved).data)

    @extend_schema(responses={204: None, **ERRORS, 409: OpenApiResponse(
        ErrorSerializer, description="A route or escalation policy still sends to it; the message names it.")})
    def destroy(self, request, *args, **kwargs):
        services.receiver_delete(receiver=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={200: DeliverySerializer(many=True), **ERRORS},
                   description="Every delivery attempt to this receiver, newest first.")
    @action(detail=True, methods=["get"])
    def deliveries(self, request, pk: int):
        receiver = self.get_object()
        attempts = Delivery.objects.filter(notification__receiver=receiver).select_related("notification").order_by(
            "-created_at", "-id")
        return self.get_paginated_response(DeliverySerializer(self.paginate_queryset(attempts), many=True).data)
