"""Silences in Alertmanager's API v2 shape: `GET/POST /api/v1/silences/`, `GET/DELETE
/api/v1/silences/{id}/` (DELETE expires it). Viewers read, operators write.

Matchers are {"name", "value", "isRegex", "isEqual"}; a regex is anchored as in Alertmanager.
Like Alertmanager, a silence must have a matcher that does not match the empty string (else it
would silence every alert), a start in the past becomes now, and ids are strings.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from alerts.inbound import alertmanager as inbound
from alerts.matchers import OPERATORS, matcher_problem
from alerts.models import Silence
from alerts.silences.muting import matcher_holds
from inferops.api import ERRORS, ErrorSerializer, PlainMetadata, RejectUnknownFields
from inferops.timeparse import parse_time

STATES = ("active", "pending", "expired")
MAX_MATCHERS = 50
OPERATOR_OF = {flags: op for op, flags in OPERATORS.items()}


class StrictBoolean(serializers.BooleanField):
    """true or false, not "yes" or 1."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be true or false.")
        return data


@extend_schema_field(OpenApiTypes.DATETIME)
class TimeField(serializers.Field):
    """ISO 8601 / RFC 3339 (or Unix seconds), as inferops reads every time."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Expected an ISO 8601 (RFC 3339) time string.")
        try:
            return parse_time(data, self.field_name)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc).removeprefix(f"{self.field_name}: ")) from None

    def to_representation(self, value):
        return value.isoformat().replace("+00:00", "Z")


class MatcherSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=200, allow_blank=True, trim_whitespace=False)
    value = serializers.CharField(max_length=1000, allow_blank=True, trim_whitespace=False)
    isRegex = StrictBoolean()  # noqa: N815 (Alertmanager's names)
    isEqual = StrictBoolean(required=False, default=True)  # noqa: N815

    def validate(self, attrs):
        op = OPERATOR_OF[(attrs["isRegex"], attrs["isEqual"])]
        if problem := matcher_problem(attrs["name"], op, attrs["value"]):
            raise serializers.ValidationError({problem[0]: [problem[1]]})
        return {"name": attrs["name"], "value": attrs["value"], "isRegex": attrs["isRegex"],
                "isEqual": attrs["isEqual"]}


class SilenceCreateSerializer(RejectUnknownFields, serializers.Serializer):
    """What a new silence needs. startsAt defaults to now; one in the past becomes now. With the
    `id` of a silence that has not expired, it updates that silence, as Alertmanager does."""

    id = serializers.CharField(required=False, max_length=20, help_text="Update this silence.")
    matchers = serializers.ListField(child=MatcherSerializer(), allow_empty=False, max_length=MAX_MATCHERS)
    startsAt = TimeField(required=False)  # noqa: N815
    endsAt = TimeField()  # noqa: N815
    createdBy = serializers.CharField(max_length=150)  # noqa: N815
    comment = serializers.CharField(max_length=5000)

    def validate(self, attrs):
        now = timezone.now()
        starts_at = max(attrs.get("startsAt") or now, now)
        if attrs["endsAt"] <= now:
            raise serializers.ValidationError({"endsAt": ["The end must be in the future."]})
        if attrs["endsAt"] <= starts_at:
            raise serializers.ValidationError({"endsAt": ["The end must be after the start."]})
        if all(matcher_holds(matcher, {}) for matcher in attrs["matchers"]):
            raise serializers.ValidationError({"matchers": [
                "At least one matcher must not match the empty label value: this silence would mute every alert."]})
        silence = {"matchers": attrs["matchers"], "starts_at": starts_at, "ends_at": attrs["endsAt"],
                   "created_by": attrs["createdBy"], "comment": attrs["comment"]}
        return {**silence, "id": attrs["id"]} if "id" in attrs else silence

    def validate_id(self, value: str) -> Silence:
        silence = Silence.objects.filter(pk=int(value)).first() if value.isdigit() else None
        if silence is None:
            raise serializers.ValidationError(f"No silence {value!r}.")
        return silence


class SilenceStatusSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=STATES)


class SilenceSerializer(serializers.ModelSerializer):
    id = serializers.SerializerMethodField()
    status = serializers.SerializerMethodField()
    matchers = MatcherSerializer(many=True)
    startsAt = TimeField(source="starts_at")  # noqa: N815
    endsAt = TimeField(source="ends_at")  # noqa: N815
    updatedAt = TimeField(source="updated_at")  # noqa: N815
    createdBy = serializers.CharField(source="created_by")  # noqa: N815

    class Meta:
        model = Silence
        fields = ["id", "status", "matchers", "startsAt", "endsAt", "updatedAt", "createdBy", "comment"]
        read_only_fields = fields

    def get_id(self, silence) -> str:
        return str(silence.pk)

    @extend_schema_field(SilenceStatusSerializer)
    def get_status(self, silence) -> dict:
        return {"state": inbound.silence_state(silence, self.context.get("now") or timezone.now())}


class SilenceCreatedSerializer(SilenceSerializer):
    silenceID = serializers.SerializerMethodField()  # noqa: N815

    class Meta(SilenceSerializer.Meta):
        fields = ["silenceID", *SilenceSerializer.Meta.fields]
        read_only_fields = fields

    def get_silenceID(self, silence) -> str:  # noqa: N802
        return str(silence.pk)


def silences_in_state(state: str, now):
    queryset = Silence.objects.all()
    if state == "expired":
        return queryset.filter(ends_at__lte=now).order_by("-ends_at", "-id")
    if state == "pending":
        return queryset.filter(starts_at__gt=now, ends_at__gt=now).order_by("starts_at", "id")
    return queryset.filter(starts_at__lte=now, ends_at__gt=now).order_by("ends_at", "id")


@extend_schema(tags=["silences"])
class SilenceViewSet(mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # The list is one bare page, as Alertmanager's; a silence is expired, never deleted.
    serializer_class = SilenceSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    queryset = Silence.objects.all()
    pagination_class = None

    @extend_schema(parameters=[OpenApiParameter("state", OpenApiTypes.STR, enum=list(STATES))],
                   responses={200: SilenceSerializer(many=True), **ERRORS},
                   summary="Silences: active (ending soonest first), then pending, then expired",
                   description="A bare list, as Alertmanager's GET /api/v2/silences answers.")
    def list(self, request):
        state = request.query_params.get("state", "")
        if state and state not in STATES:
            raise serializers.ValidationError({"state": [f"{state!r}: use one of {', '.join(STATES)}."]})
        now = timezone.now()
        silences = [s for wanted in ([state] if state else STATES) for s in silences_in_state(wanted, now)]
        return Response(SilenceSerializer(silences, many=True, context={"now": now}).data)

    @extend_schema(request=SilenceCreateSerializer,
                   responses={201: SilenceCreatedSerializer, 200: SilenceCreatedSerializer, **ERRORS,
                              409: OpenApiResponse(ErrorSerializer, description="The silence to update expired.")},
                   summary="Create a silence (201), or update one given its id (200): matching alerts are kept "
                           "and shown but notify no one",
                   description="An update with the same matchers changes the silence in place; new matchers "
                               "expire it and create a new one, whose id the answer gives (Alertmanager's rule).")
    def create(self, request):
        serializer = SilenceCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        if (existing := fields.pop("id", None)) is not None:
            silence = inbound.silence_update(silence=existing, **fields, actor=request.user)
            return Response(SilenceCreatedSerializer(silence).data, status=status.HTTP_200_OK)
        silence = inbound.silence_create(**fields, actor=request.user)
        return Response(SilenceCreatedSerializer(silence).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: SilenceSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(responses={200: SilenceSerializer, **ERRORS,
                              409: OpenApiResponse(ErrorSerializer, description="Already expired.")},
                   summary="Expire the silence now (it stays, as history)")
    def destroy(self, request, *args, **kwargs):
        silence = inbound.silence_expire(silence=self.get_object(), actor=request.user)
        return Response(SilenceSerializer(silence).data)
