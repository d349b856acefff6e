"""REST API of the routing tree and escalation policies. Viewers read, operators write.

`/api/v1/routes/`: every route, the default one first, each with its `parent`. A route sends to a
`receiver` or an `escalation_policy` (by name); one with neither inherits its parent's, and unset
grouping settings (null) are inherited too, as in Alertmanager's configuration.
`/api/v1/escalation-policies/`: `{"name", "description", "steps": [{"after_minutes",
"receivers", "users", "schedule"}]}`, steps in order.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from alerts.choices import MatchOp
from alerts.matchers import matcher_problem
from alerts.models import EscalationPolicy, Receiver, Route, Schedule
from alerts.routing import services as route_services
from alerts.routing.dispatch import default_route
from inferops.api import ERRORS, ErrorSerializer, PlainMetadata, RejectUnknownFields
from inferops.validators import slug_validator

CONFLICT = {409: OpenApiResponse(ErrorSerializer, description="A name taken, or something still uses it.")}


def as_drf(exc: DjangoValidationError) -> serializers.ValidationError:
    return serializers.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})


class RouteMatcherSerializer(RejectUnknownFields, serializers.Serializer):
    name = serializers.CharField(max_length=200, allow_blank=True, trim_whitespace=False)
    value = serializers.CharField(max_length=1000, allow_blank=True, trim_whitespace=False)
    op = serializers.ChoiceField(choices=MatchOp.choices, default=MatchOp.EQUAL, error_messages={
        "invalid_choice": '"{input}" is not an operator: use one of = != =~ !~.'})

    def validate(self, attrs):
        # .get: a PATCH makes nested fields optional too, and the default op is then not filled in.
        if problem := matcher_problem(attrs.get("name"), attrs.get("op", MatchOp.EQUAL), attrs.get("value")):
            raise serializers.ValidationError({problem[0]: [problem[1]]})
        return attrs


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be true or false.")
        return data


class RouteSerializer(RejectUnknownFields, serializers.ModelSerializer):
    matchers = RouteMatcherSerializer(many=True, required=False)
    receiver = serializers.SlugRelatedField(slug_field="name", queryset=Receiver.objects.all(), allow_null=True,
                                            required=False)
    escalation_policy = serializers.SlugRelatedField(slug_field="name", queryset=EscalationPolicy.objects.all(),
                                                     allow_null=True, required=False)
    parent = serializers.PrimaryKeyRelatedField(queryset=Route.objects.all(), allow_null=True, required=False,
                                                help_text="The parent route's id; absent: under the default route.")
    group_by = serializers.ListField(child=serializers.CharField(max_length=200), allow_null=True, required=False,
                                     help_text='Label names; ["..."] groups by every label; null inherits.')
    group_wait_s = serializers.IntegerField(min_value=0, max_value=86400, allow_null=True, required=False)
    group_interval_s = serializers.IntegerField(min_value=1, max_value=86400 * 7, allow_null=True, required=False)
    repeat_interval_s = serializers.IntegerField(min_value=60, max_value=86400 * 30, allow_null=True,
                                                 required=False)
    continue_ = StrictBooleanField(source="continue_matching", required=False,
                                   help_text="Alertmanager's `continue`: later siblings may take the alert too.")
    position = serializers.IntegerField(min_value=-1000000, max_value=1000000, required=False)

    class Meta:
        model = Route
        fields = ["id", "is_default", "parent", "position", "matchers", "receiver", "escalation_policy", "group_by",
                  "group_wait_s", "group_interval_s", "repeat_interval_s", "continue_", "created_at", "updated_at"]
        read_only_fields = ["id", "is_default", "created_at", "updated_at"]

    def get_fields(self):
        fields = super().get_fields()
        fields["continue"] = fields.pop("continue_")  # a Python keyword, Alertmanager's name
        return fields


@extend_schema(tags=["routes"])
class RouteViewSet(mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # The routing tree is one unpaginated list, the default route first; PUT changes a route as PATCH does.
    serializer_class = RouteSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    queryset = Route.objects.all()
    pagination_class = None

    @extend_schema(responses={200: RouteSerializer(many=True), **ERRORS},
                   summary="The routing tree: every route, the default route first")
    def list(self, request):
        root = default_route()
        routes = [root, *Route.objects.exclude(pk=root.pk).select_related("receiver", "escalation_policy")
                  .order_by("parent_id", "position", "id")]
        return Response(RouteSerializer(routes, many=True).data)

    @extend_schema(request=RouteSerializer, responses={201: RouteSerializer, **ERRORS},
                   summary="Add a route (under the default route unless `parent` names another)")
    def create(self, request):
        serializer = RouteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            route = route_services.route_save(instance=None, fields=dict(serializer.validated_data),
                                              actor=request.user)
        except DjangoValidationError as exc:
            raise as_drf(exc) from None
        return Response(RouteSerializer(route).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: RouteSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=RouteSerializer, responses={200: RouteSerializer, **ERRORS},
                   summary="Change a route: the fields given change, the others stay")
    def partial_update(self, request, pk: int):
        route = self.get_object()
        serializer = RouteSerializer(route, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        try:
            route = route_services.route_save(instance=route, fields=dict(serializer.validated_data),
                                              actor=request.user)
        except DjangoValidationError as exc:
            raise as_drf(exc) from None
        return Response(RouteSerializer(route).data)

    @extend_schema(responses={204: None, **ERRORS, **CONFLICT}, summary="Delete a route and the routes under it")
    def destroy(self, request, *args, **kwargs):
        route_services.route_delete(route=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


# ---------------------------------------------------------------------------- escalation policies


class StepSerializer(RejectUnknownFields, serializers.Serializer):
    after_minutes = serializers.IntegerField(min_value=0, max_value=7 * 24 * 60,
                                             help_text="Minutes after the first notification, if still unacknowledged.")
    receivers = serializers.SlugRelatedField(slug_field="name", queryset=Receiver.objects.all(), many=True,
                                             required=False, default=list)
    users = serializers.SlugRelatedField(slug_field="username", queryset=get_user_model().objects.all(), many=True,
                                         required=False, default=list, help_text="Paged by email.")
    schedule = serializers.SlugRelatedField(slug_field="name", queryset=Schedule.objects.all(), allow_null=True,
                                            required=False, default=None, help_text="Whoever is on call then.")


class EscalationPolicySerializer(RejectUnknownFields, serializers.ModelSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    steps = StepSerializer(many=True)

    class Meta:
        model = EscalationPolicy
        fields = ["id", "name", "description", "steps", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]

    def to_representation(self, policy):
        data = super().to_representation(policy)
        data["steps"] = [{"after_minutes": s.after_minutes, "receivers": [r.name for r in s.receivers.all()],
                          "users": [u.username for u in s.users.all()],
                          "schedule": s.schedule.name if s.schedule else None} for s in policy.steps.all()]
        return data


def policy_write(request, instance: EscalationPolicy | None) -> EscalationPolicy:
    serializer = EscalationPolicySerializer(instance, data=request.data)
    serializer.is_valid(raise_exception=True)
    fields = dict(serializer.validated_data)
    steps = fields.pop("steps")
    try:
        return route_services.policy_save(instance=instance, fields=fields, steps=steps, actor=request.user)
    except DjangoValidationError as exc:
        raise as_drf(exc) from None


def policies():
    return EscalationPolicy.objects.prefetch_related("steps__receivers", "steps__users", "steps__schedule")


@extend_schema(tags=["escalation policies"])
class EscalationPolicyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Few policies: one unpaginated list. A policy is replaced whole (PUT), its steps with it.
    serializer_class = EscalationPolicySerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    pagination_class = None
    lookup_field = "name"

    def get_queryset(self):
        return policies()

    @extend_schema(responses={200: EscalationPolicySerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=EscalationPolicySerializer, responses={201: EscalationPolicySerializer, **ERRORS,
                                                                   **CONFLICT},
                   summary="Create an escalation policy: who is notified while an alert stays unacknowledged")
    def create(self, request):
        policy = policy_write(request, None)
        return Response(EscalationPolicySerializer(policies().get(pk=policy.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: EscalationPolicySerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=EscalationPolicySerializer, responses={200: EscalationPolicySerializer, **ERRORS,
                                                                   **CONFLICT},
                   summary="Replace the policy and its steps")
    def update(self, request, *args, **kwargs):
        policy = policy_write(request, self.get_object())
        return Response(EscalationPolicySerializer(policies().get(pk=policy.pk)).data)

    @extend_schema(responses={204: None, **ERRORS, **CONFLICT}, summary="Delete a policy no route uses")
    def destroy(self, request, *args, **kwargs):
        route_services.policy_delete(policy=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
