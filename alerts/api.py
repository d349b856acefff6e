"""REST API for alerts (read by anyone with a role) and webhook receivers (admins only)."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from alerts.choices import AlertStatus, Severity
from alerts.models import Alert, Delivery, Receiver
from inferops.api import Conflict
from inferops.roles import ADMIN
from registry.api import CONFLICT, ERRORS
from registry.models import slug_validator
from registry.services import audit_record, snapshot


class AlertSerializer(serializers.ModelSerializer):
    slo = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Alert
        fields = ["id", "fingerprint", "slo", "severity", "status", "starts_at", "ends_at", "updated_at", "labels",
                  "annotations"]
        read_only_fields = fields


class ReceiverSerializer(serializers.ModelSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    url = serializers.URLField(max_length=500)

    class Meta:
        model = Receiver
        fields = ["id", "name", "url", "send_resolved", "active", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]


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
class AlertList(generics.ListAPIView):
    serializer_class = AlertSerializer

    def get_queryset(self):
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
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["alerts"])
class AlertDetail(APIView):
    @extend_schema(responses={200: AlertSerializer, **ERRORS})
    def get(self, request, pk: int):
        return Response(AlertSerializer(get_object_or_404(Alert.objects.select_related("slo"), pk=pk)).data)


def receiver_save(*, serializer: ReceiverSerializer, actor) -> Receiver:
    before = snapshot(serializer.instance) if serializer.instance else None
    try:
        with transaction.atomic():
            receiver = serializer.save()
            audit_record(actor=actor, action="receiver.update" if before else "receiver.create", obj=receiver,
                         before=before, after=snapshot(receiver))
    except IntegrityError:
        raise Conflict(f"A receiver named {serializer.validated_data.get('name')!r} already exists.") from None
    return receiver


@extend_schema(tags=["alerts"])
class ReceiverListCreate(generics.ListAPIView):
    serializer_class = ReceiverSerializer
    queryset = Receiver.objects.all()
    read_role = ADMIN
    write_role = ADMIN

    @extend_schema(request=ReceiverSerializer, responses={201: ReceiverSerializer, **ERRORS, **CONFLICT})
    def post(self, request):
        serializer = ReceiverSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        receiver = receiver_save(serializer=serializer, actor=request.user)
        return Response(ReceiverSerializer(receiver).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["alerts"])
class ReceiverDetail(APIView):
    read_role = ADMIN
    write_role = ADMIN

    @extend_schema(responses={200: ReceiverSerializer, **ERRORS})
    def get(self, request, pk: int):
        return Response(ReceiverSerializer(get_object_or_404(Receiver, pk=pk)).data)

    @extend_schema(request=ReceiverSerializer, responses={200: ReceiverSerializer, **ERRORS, **CONFLICT})
    def patch(self, request, pk: int):
        serializer = ReceiverSerializer(get_object_or_404(Receiver, pk=pk), data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        return Response(ReceiverSerializer(receiver_save(serializer=serializer, actor=request.user)).data)

    @extend_schema(responses={204: None, **ERRORS})
    def delete(self, request, pk: int):
        receiver = get_object_or_404(Receiver, pk=pk)
        with transaction.atomic():
            audit_record(actor=request.user, action="receiver.delete", obj=receiver, before=snapshot(receiver))
            receiver.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema(tags=["alerts"])
class ReceiverDeliveries(generics.ListAPIView):
    serializer_class = DeliverySerializer
    read_role = ADMIN

    def get_queryset(self):
        receiver = get_object_or_404(Receiver, pk=self.kwargs["pk"])
        return Delivery.objects.filter(notification__receiver=receiver).select_related("notification").order_by(
            "-created_at", "-id")

    @extend_schema(responses={200: DeliverySerializer(many=True), **ERRORS},
                   description="Every delivery attempt to this receiver, newest first.")
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)
