"""REST API of on-call schedules: `GET/POST /api/v1/schedules/`, `GET/PUT/DELETE
/api/v1/schedules/{name}/`, who is on call (`on-call/?at=`), the timeline (`shifts/?start=&end=`)
and overrides (`POST overrides/`, `DELETE overrides/{id}/`). Viewers read, operators write.

Layers are listed lowest first: a later layer overrides an earlier one where it has someone.
Users are named by username. The serializers check shapes; alerts.schedules.services checks the rest
(time zone, users, members, dates), so the console and the API refuse the same input alike.
"""

from __future__ import annotations

from datetime import timedelta

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from alerts.choices import Rotation
from alerts.models import Schedule, ScheduleOverride
from alerts.schedules import services as schedules
from alerts.silences.api import TimeField
from inferops.api import CONFLICT, ERRORS, ErrorSerializer, PlainMetadata, RejectUnknownFields, query_time
from inferops.validators import slug_validator

DEFAULT_SPAN = timedelta(days=14)
MAX_SPAN = timedelta(days=90)
MAX_LAYERS = 20
MAX_MEMBERS = 100


def iso(moment):
    return moment.isoformat().replace("+00:00", "Z") if moment else None


class LayerSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=63, required=False, allow_blank=True, default="")
    rotation = serializers.ChoiceField(choices=Rotation.choices)
    starts_at = TimeField(help_text="The first hand-off; later ones happen at its local time in the schedule's zone.")
    ends_at = TimeField(required=False, allow_null=True, default=None)
    users = serializers.ListField(child=serializers.CharField(max_length=150), max_length=MAX_MEMBERS,
                                  help_text="Usernames in rotation order; a user may take several turns.")


class ScheduleWriteSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    time_zone = serializers.CharField(max_length=64, default="UTC", help_text="e.g. Europe/Berlin")
    description = serializers.CharField(required=False, allow_blank=True, default="")
    layers = serializers.ListField(child=LayerSerializer(), max_length=MAX_LAYERS,
                                   help_text="Lowest first: later layers override earlier ones.")


class OverrideSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username")
    starts_at = TimeField()
    ends_at = TimeField()
    created_by = serializers.CharField(source="created_by.username", default=None)

    class Meta:
        model = ScheduleOverride
        fields = ["id", "user", "starts_at", "ends_at", "reason", "created_by", "created_at"]
        read_only_fields = fields


class OverrideCreateSerializer(RejectUnknownFields, serializers.Serializer):
    user = serializers.CharField(max_length=150)
    starts_at = TimeField()
    ends_at = TimeField()
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    def validate(self, attrs):
        if attrs["ends_at"] <= attrs["starts_at"]:
            raise serializers.ValidationError({"ends_at": ["ends_at must come after starts_at."]})
        return attrs


class ScheduleSerializer(serializers.ModelSerializer):
    layers = serializers.SerializerMethodField()
    overrides = serializers.SerializerMethodField(help_text="Overrides now and to come.")

    class Meta:
        model = Schedule
        fields = ["name", "time_zone", "description", "layers", "overrides", "created_at", "updated_at"]
        read_only_fields = fields

    @extend_schema_field(LayerSerializer(many=True))
    def get_layers(self, schedule) -> list[dict]:
        return [{"name": layer.name, "rotation": layer.rotation, "starts_at": iso(layer.starts_at),
                 "ends_at": iso(layer.ends_at),
                 "users": [member.user.username for member in layer.members.select_related("user")]}
                for layer in schedule.layers.all()]

    @extend_schema_field(OverrideSerializer(many=True))
    def get_overrides(self, schedule) -> list[dict]:
        upcoming = schedule.overrides.filter(ends_at__gt=timezone.now()).select_related("user", "created_by")
        return OverrideSerializer(upcoming, many=True).data


# The on-call answer is built by hand (`from` is a Python keyword); this is its schema.
OnCallSerializer = inline_serializer("OnCall", {
    "now": inline_serializer("OnCallNow", {
        "user": serializers.CharField(allow_null=True, help_text="Username; null when nobody is on call."),
        "until": TimeField(allow_null=True, help_text="When that changes; null if not within 60 days."),
    }),
    "next": inline_serializer("OnCallNext", {
        "user": serializers.CharField(allow_null=True, help_text="Username; null when nobody will be."),
        "from": TimeField(),
    }, allow_null=True, help_text="null when the person on call stays the same for 60 days."),
})


class ShiftSerializer(serializers.Serializer):
    user = serializers.CharField()
    starts_at = TimeField()
    ends_at = TimeField()
    source = serializers.CharField(help_text='"override" or "layer N" (1 is the lowest).')


def username(user) -> str | None:
    return user.username if user is not None else None


def on_call_body(summary: dict) -> dict:
    """alerts.schedules.services.on_call_summary as JSON: usernames and ISO 8601 times."""
    upcoming = summary["next"]
    return {"now": {"user": username(summary["now"]["user"]), "until": iso(summary["now"]["until"])},
            "next": {"user": username(upcoming["user"]), "from": iso(upcoming["from"])} if upcoming else None}


def get_schedule(name: str) -> Schedule:
    return get_object_or_404(Schedule, name=name)


def save_arguments(data: dict) -> dict:
    return {"fields": {key: data[key] for key in ("name", "time_zone", "description")}, "layers": data["layers"]}


@extend_schema(tags=["schedules"])
class ScheduleViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Schedules (one unpaginated list, by name; PUT replaces the layers), who is on call, and the shifts.
    serializer_class = ScheduleSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    queryset = Schedule.objects.all()
    pagination_class = None
    lookup_field = "name"

    @extend_schema(responses={200: ScheduleSerializer(many=True), **ERRORS}, summary="On-call schedules, by name")
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=ScheduleWriteSerializer, responses={201: ScheduleSerializer, **ERRORS, **CONFLICT},
                   summary="Create a schedule with its layers")
    def create(self, request):
        serializer = ScheduleWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        schedule = schedules.schedule_save(instance=None, **save_arguments(serializer.validated_data),
                                           actor=request.user)
        return Response(ScheduleSerializer(schedule).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: ScheduleSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=ScheduleWriteSerializer, responses={200: ScheduleSerializer, **ERRORS, **CONFLICT},
                   summary="Replace the schedule and all its layers (overrides stay)")
    def update(self, request, *args, **kwargs):
        schedule = self.get_object()
        serializer = ScheduleWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        schedule = schedules.schedule_save(instance=schedule, **save_arguments(serializer.validated_data),
                                           actor=request.user)
        return Response(ScheduleSerializer(schedule).data)

    @extend_schema(responses={204: None, **ERRORS,
                              409: OpenApiResponse(ErrorSerializer, description="An escalation policy uses it.")})
    def destroy(self, request, *args, **kwargs):
        schedules.schedule_delete(schedule=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(parameters=[OpenApiParameter("at", OpenApiTypes.DATETIME, description="Default: now.")],
                   responses={200: OnCallSerializer, **ERRORS}, summary="Who is on call at a time, and who is next")
    @action(detail=True, methods=["get"], url_path="on-call")
    def on_call(self, request, name: str):
        schedule = self.get_object()
        at = query_time(request.query_params.get("at"), "at", timezone.now())
        return Response(on_call_body(schedules.on_call_summary(schedule, at)))

    @extend_schema(parameters=[OpenApiParameter("start", OpenApiTypes.DATETIME, description="Default: now."),
                               OpenApiParameter("end", OpenApiTypes.DATETIME,
                                                description="Default: start + 14 days; at most 90 days after start.")],
                   responses={200: ShiftSerializer(many=True), **ERRORS},
                   summary="The final on-call timeline (overrides over layers, higher layers over lower)")
    @action(detail=True, methods=["get"])
    def shifts(self, request, name: str):
        schedule = self.get_object()
        start = query_time(request.query_params.get("start"), "start", timezone.now())
        end = query_time(request.query_params.get("end"), "end", start + DEFAULT_SPAN)
        if end <= start:
            raise serializers.ValidationError({"end": ["end must come after start."]})
        if end - start > MAX_SPAN:
            raise serializers.ValidationError({"end": [f"At most {MAX_SPAN.days} days after start."]})
        return Response([{**piece, "user": piece["user"].username, "starts_at": iso(piece["starts_at"]),
                          "ends_at": iso(piece["ends_at"])} for piece in schedules.shifts(schedule, start, end)])


@extend_schema(tags=["schedules"])
class ScheduleOverrideViewSet(viewsets.GenericViewSet):
    # A schedule's overrides are added and removed; they are read with the schedule.
    serializer_class = OverrideSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered

    def get_queryset(self):
        return ScheduleOverride.objects.filter(schedule=get_schedule(self.kwargs["name"]))

    @extend_schema(request=OverrideCreateSerializer, responses={201: OverrideSerializer, **ERRORS},
                   summary="Someone takes the schedule for a while, above every layer")
    def create(self, request, name: str):
        schedule = get_schedule(name)
        serializer = OverrideCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        override = schedules.override_create(schedule=schedule, username=data["user"], starts_at=data["starts_at"],
                                             ends_at=data["ends_at"], reason=data["reason"], actor=request.user)
        return Response(OverrideSerializer(override).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None, **ERRORS})
    def destroy(self, request, *args, **kwargs):
        schedules.override_delete(override=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
