"""REST API for deployments: CRUD, replicas, and metrics series for CI and the console."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

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
from rest_framework import generics, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments import rollouts, services
from deployments.choices import Backend, DriverName, RolloutStatus, Strategy, Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from inferops.api import ErrorSerializer
from registry.api import CONFLICT, ERRORS, TOO_LARGE
from registry.models import RegisteredModel, slug_validator
from runtime.choices import ReplicaState
from runtime.models import Replica

SERIES_UNITS = {
    "requests_per_s": "requests/s", "output_tokens_per_s": "tokens/s", "ttft_p50": "ms", "ttft_p95": "ms",
    "ttft_p99": "ms", "itl_p95": "ms", "kv_cache_usage": "fraction", "queue_depth": "requests",
}
SERIES = list(SERIES_UNITS)
MAX_POINTS = 5000


class ReplicaSerializer(serializers.ModelSerializer):
    version = serializers.IntegerField(source="version.number")

    class Meta:
        model = Replica
        fields = ["id", "version", "state", "url", "restarts", "crash_looping", "started_at", "ready_at",
                  "last_health_at", "last_health_ok", "last_error", "node", "driver"]
        read_only_fields = fields


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name")
    version = serializers.IntegerField(source="version.number")
    ready_replicas = serializers.SerializerMethodField(
        help_text="Ready replicas of the pinned version: CI waits until it equals `replicas` "
                  "and `up_to_date` is true.")
    up_to_date = serializers.SerializerMethodField(
        help_text="True when exactly the desired replicas of the pinned version are ready and no "
                  "replica of another version or spec is still serving.")

    class Meta:
        model = Deployment
        fields = ["name", "model", "version", "alias", "backend", "driver", "engine_args", "replicas",
                  "min_replicas", "max_replicas", "autoscale", "resources", "paused", "ready_replicas",
                  "up_to_date", "status", "status_message", "created_at", "updated_at"]
        read_only_fields = fields

    def _live(self, deployment) -> list[Replica]:
        cache = self.context.setdefault("_live", {})
        if deployment.pk not in cache:
            cache[deployment.pk] = [r for r in deployment.replica_set.all()
                                    if r.state not in (ReplicaState.STOPPED,)]
        return cache[deployment.pk]

    def get_ready_replicas(self, deployment) -> int:
        return sum(r.state == ReplicaState.READY and r.version_id == deployment.version_id
                   for r in self._live(deployment))

    def get_up_to_date(self, deployment) -> bool:
        live = self._live(deployment)
        others = [r for r in live if r.version_id != deployment.version_id or r.engine_args != deployment.engine_args]
        return not others and self.get_ready_replicas(deployment) == deployment.replicas and not deployment.paused


class DeploymentCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    model = serializers.CharField(max_length=63)
    version = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    alias = serializers.CharField(max_length=63, required=False, allow_blank=True)
    backend = serializers.ChoiceField(Backend.choices, default=Backend.BUILTIN)
    driver = serializers.ChoiceField(DriverName.choices, default=DriverName.LOCAL)
    replicas = serializers.IntegerField(min_value=0, max_value=256, default=1)
    min_replicas = serializers.IntegerField(min_value=0, max_value=256, required=False)
    max_replicas = serializers.IntegerField(min_value=0, max_value=256, required=False)
    autoscale = serializers.BooleanField(default=False)
    engine_args = serializers.DictField(required=False, default=dict)
    resources = serializers.DictField(required=False, default=dict)

    def validate_model(self, value: str) -> RegisteredModel:
        model = RegisteredModel.objects.filter(name=value).first()
        if model is None:
            raise serializers.ValidationError(f"No registered model named {value!r}.")
        return model


class DeploymentUpdateSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1, required=False)
    alias = serializers.CharField(max_length=63, required=False)
    replicas = serializers.IntegerField(min_value=0, max_value=256, required=False)
    min_replicas = serializers.IntegerField(min_value=0, max_value=256, required=False)
    max_replicas = serializers.IntegerField(min_value=0, max_value=256, required=False)
    autoscale = serializers.BooleanField(required=False)
    paused = serializers.BooleanField(required=False)
    engine_args = serializers.DictField(required=False)
    resources = serializers.DictField(required=False)

    def validate(self, attrs):
        unknown = set(self.initial_data) - set(self.fields)
        if unknown:
            raise serializers.ValidationError(
                {key: ["Not a field that can be changed."] for key in sorted(unknown)})
        return attrs


def deployment_queryset():
    return Deployment.objects.select_related("model", "version").prefetch_related("replica_set")


def get_deployment(name: str) -> Deployment:
    return get_object_or_404(deployment_queryset(), name=name)


@extend_schema(tags=["deployments"])
class DeploymentListCreate(generics.ListAPIView):
    serializer_class = DeploymentSerializer

    def get_queryset(self):
        queryset = deployment_queryset()
        if model := self.request.query_params.get("model"):
            queryset = queryset.filter(model__name=model)
        if state := self.request.query_params.get("status"):
            queryset = queryset.filter(status=state)
        return queryset

    @extend_schema(parameters=[OpenApiParameter("model", OpenApiTypes.STR),
                               OpenApiParameter("status", OpenApiTypes.STR)],
                   responses={200: DeploymentSerializer(many=True), **ERRORS})
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(request=DeploymentCreateSerializer,
                   responses={201: DeploymentSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def post(self, request):
        serializer = DeploymentCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        deployment = services.deployment_create(actor=request.user, **data)
        return Response(DeploymentSerializer(get_deployment(deployment.name)).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["deployments"])
class DeploymentDetail(APIView):
    @extend_schema(responses={200: DeploymentSerializer, **ERRORS})
    def get(self, request, name: str):
        return Response(DeploymentSerializer(get_deployment(name)).data)

    @extend_schema(request=DeploymentUpdateSerializer, responses={200: DeploymentSerializer, **ERRORS})
    def patch(self, request, name: str):
        deployment = get_deployment(name)
        serializer = DeploymentUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.deployment_update(deployment=deployment, actor=request.user, **serializer.validated_data)
        return Response(DeploymentSerializer(get_deployment(name)).data)

    @extend_schema(responses={202: DeploymentSerializer, **ERRORS},
                   description="Drains and stops every replica, then removes the deployment.")
    def delete(self, request, name: str):
        deployment = services.deployment_delete(deployment=get_deployment(name), actor=request.user)
        return Response(DeploymentSerializer(get_deployment(deployment.name)).data, status=status.HTTP_202_ACCEPTED)


@extend_schema(tags=["deployments"])
class ReplicaList(APIView):
    @extend_schema(parameters=[OpenApiParameter("all", OpenApiTypes.BOOL,
                                                description="Include stopped replicas.")],
                   responses={200: ReplicaSerializer(many=True), **ERRORS})
    def get(self, request, name: str):
        deployment = get_deployment(name)
        replicas = deployment.replica_set.select_related("version").order_by("id")
        if request.query_params.get("all") not in ("1", "true"):
            replicas = replicas.exclude(state=ReplicaState.STOPPED)
        return Response(ReplicaSerializer(replicas, many=True).data)


def parse_time(value: str | None, field: str, default: datetime) -> datetime:
    if not value:
        return default
    try:
        if value.replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(value), tz=UTC)
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        message = f"{value!r} is not an ISO 8601 time or a Unix timestamp."
        raise serializers.ValidationError({field: [message]}) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_step(value: str | None) -> int:
    if not value:
        return 60
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = int(value[:-1]) * units[value[-1]] if value[-1] in units else int(value)
    except (ValueError, KeyError):
        raise serializers.ValidationError({"step": [f"{value!r}: use seconds or 30s, 5m, 1h."]}) from None
    if seconds < 15:
        raise serializers.ValidationError({"step": ["step must be at least 15 seconds."]})
    return seconds


@extend_schema(tags=["deployments"])
class DeploymentMetrics(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("series", OpenApiTypes.STR, enum=SERIES, required=True),
            OpenApiParameter("start", OpenApiTypes.STR, description="ISO 8601 or Unix time; default end - 1h"),
            OpenApiParameter("end", OpenApiTypes.STR, description="ISO 8601 or Unix time; default now"),
            OpenApiParameter("step", OpenApiTypes.STR, description="seconds or 30s/5m/1h; default 60s"),
            OpenApiParameter("version", OpenApiTypes.INT, description="only this version's replicas"),
        ],
        responses={200: inline_serializer("MetricsSeries", {
            "series": serializers.CharField(), "unit": serializers.CharField(),
            "points": serializers.ListField(child=serializers.ListField()),
        }), **ERRORS},
    )
    def get(self, request, name: str):
        from runtime.metrics_query import deployment_series

        deployment = get_deployment(name)
        params = request.query_params
        series = params.get("series")
        if series not in SERIES:
            return Response({"series": [f"One of: {', '.join(SERIES)}."]}, status=status.HTTP_400_BAD_REQUEST)
        end = parse_time(params.get("end"), "end", timezone.now())
        start = parse_time(params.get("start"), "start", end - timedelta(hours=1))
        step = parse_step(params.get("step"))
        if start >= end:
            return Response({"start": ["start must be before end."]}, status=status.HTTP_400_BAD_REQUEST)
        if (end - start).total_seconds() / step > MAX_POINTS:
            return Response({"step": [f"More than {MAX_POINTS} points; use a larger step."]},
                            status=status.HTTP_400_BAD_REQUEST)
        version = params.get("version")
        if version is not None and not version.isdigit():
            return Response({"version": ["Must be a version number."]}, status=status.HTTP_400_BAD_REQUEST)
        points = deployment_series(deployment, series, start, end, step,
                                   version=int(version) if version else None)
        return Response({"series": series, "unit": SERIES_UNITS[series], "points": points})


# ---------------------------------------------------------------------------- rollouts

MAX_MEASUREMENTS = 50
ROLLOUT_ERRORS = {**ERRORS, 404: OpenApiResponse(ErrorSerializer, description="Unknown deployment or rollout.")}
ROLLOUT_CONFLICT = {409: OpenApiResponse(ErrorSerializer, description=(
    "Refused in the current state, with the reason: another rollout of the deployment is active, an SLO's "
    "error budget is exhausted (the SLO is named), the rollout has already finished, or the deployment is "
    "paused or being deleted."))}


@extend_schema_field({"type": "array", "items": {"type": "object"},
                      "example": [{"set_weight": 20}, {"pause": "60s"}, {"analysis": "2m"}]})
class StepsField(serializers.JSONField):
    """Canary steps; their content is checked by deployments.rollout_spec, one message per bad step."""


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "number"}], "example": "10m"})
class DurationField(serializers.JSONField):
    """A duration: "90s", "2m", "1h30m" or a number of seconds (checked by rollout_spec)."""


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "object"}], "example": "2m"})
class DurationOrObjectField(serializers.JSONField):
    """A duration, or an object (preview `{}`: until promoted; analysis: duration, min_requests, ...)."""


class StrictSerializer(serializers.Serializer):
    """Unknown keys are refused with a 400 naming each of them."""

    def validate(self, attrs):
        unknown = set(self.initial_data) - set(self.fields)
        if unknown:
            raise serializers.ValidationError({key: ["Unknown field."] for key in sorted(unknown)})
        return attrs


class RolloutCreateSerializer(StrictSerializer):
    version = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                       help_text="Candidate version number (or give `alias`).")
    alias = serializers.CharField(max_length=63, required=False, allow_blank=True,
                                  help_text="Candidate version by alias, resolved now.")
    engine_args = serializers.DictField(required=False, help_text=(
        "Candidate engine arguments (replace the deployment's); omitted: the deployment's own."))
    strategy = serializers.ChoiceField(Strategy.choices, default=Strategy.CANARY)
    steps = StepsField(required=False, allow_null=True, help_text=(
        "Canary: set_weight (percent), pause (duration, or {} until promoted) and analysis (duration or "
        "{duration, min_requests, max_burn_rate, thresholds}). Omitted: 10% / analysis 2m / 50% / analysis 2m."))
    scale_down_delay = DurationField(required=False, allow_null=True,
                                     help_text="Blue-green: how long the old set stays warm after the switch.")
    preview = DurationOrObjectField(required=False, allow_null=True, help_text=(
        "Blue-green: keep the candidate on `<deployment>--preview` for this long ({} = until promoted)."))
    analysis = DurationOrObjectField(required=False, allow_null=True,
                                     help_text="Blue-green: analysis after the switch (duration or object).")
    rollback = serializers.BooleanField(default=False, help_text="A rollback: allowed while a budget is exhausted.")
    override_reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000, help_text=(
        "Go ahead although an SLO's error budget is exhausted; recorded in the audit log."))
    promote_alias = serializers.CharField(max_length=63, allow_blank=True, default="champion",
                                          validators=[slug_validator],
                                          help_text="Alias moved to the candidate on success; \"\" for none.")


class PromoteSerializer(StrictSerializer):
    full = serializers.BooleanField(default=False, help_text="Skip every remaining step.")


class AbortSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class RetrySerializer(StrictSerializer):
    override_reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class UndoSerializer(StrictSerializer):
    pass


class RolloutSpecSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    engine_args = serializers.DictField()


class CandidateSpecSerializer(RolloutSpecSerializer):
    alias = serializers.CharField(help_text="The alias the candidate was resolved from, if any.")


class CurrentStepSerializer(serializers.Serializer):
    index = serializers.IntegerField(help_text="Equals the number of steps once every step is done.")
    step = serializers.DictField(allow_null=True)


class TimelineEntrySerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    event = serializers.CharField()
    detail = serializers.CharField()


class CheckSerializer(serializers.Serializer):
    name = serializers.CharField()
    candidate = serializers.FloatField(allow_null=True)
    stable = serializers.FloatField(allow_null=True)
    limit = serializers.FloatField(allow_null=True)
    ok = serializers.BooleanField(allow_null=True, help_text="null: not judged.")


@extend_schema_field(TimelineEntrySerializer(many=True))
class TimelineField(serializers.JSONField):
    pass


@extend_schema_field(CheckSerializer(many=True))
class ChecksField(serializers.JSONField):
    pass


class MeasurementSerializer(serializers.ModelSerializer):
    verdict = serializers.ChoiceField(Verdict.choices)
    checks = ChecksField()
    candidate = serializers.JSONField(help_text="requests, failures, latency percentiles, burn rate per SLO.")
    stable = serializers.JSONField()

    class Meta:
        model = RolloutMeasurement
        fields = ["id", "step_index", "taken_at", "window_start", "window_end", "verdict", "checks", "candidate",
                  "stable", "reason"]
        read_only_fields = fields


class RolloutSerializer(serializers.ModelSerializer):
    deployment = serializers.CharField(source="deployment.name")
    status = serializers.ChoiceField(RolloutStatus.choices, help_text=(
        "progressing or paused while it runs; succeeded or aborted when done."))
    stable = serializers.SerializerMethodField()
    candidate = serializers.SerializerMethodField()
    steps = StepsField()
    current_step = serializers.SerializerMethodField()
    weight = serializers.IntegerField(help_text="Percent of traffic on the candidate now.")
    timeline = TimelineField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)

    class Meta:
        model = Rollout
        fields = ["id", "deployment", "strategy", "status", "rollback", "stable", "candidate", "steps", "current_step",
                  "weight", "message", "timeline", "scale_down_delay_s", "scale_down_at", "promote_alias",
                  "override_reason", "created_by", "created_at", "updated_at", "finished_at"]
        read_only_fields = fields

    @extend_schema_field(RolloutSpecSerializer)
    def get_stable(self, rollout: Rollout) -> dict:
        return {"version": rollout.stable_version.number, "engine_args": rollout.stable_engine_args}

    @extend_schema_field(CandidateSpecSerializer)
    def get_candidate(self, rollout: Rollout) -> dict:
        return {"version": rollout.candidate_version.number, "engine_args": rollout.candidate_engine_args,
                "alias": rollout.candidate_alias}

    @extend_schema_field(CurrentStepSerializer)
    def get_current_step(self, rollout: Rollout) -> dict:
        return {"index": rollout.step_index, "step": rollout.current_step}


class RolloutDetailSerializer(RolloutSerializer):
    measurements = serializers.SerializerMethodField(
        help_text=f"Analysis measurements, latest first (at most {MAX_MEASUREMENTS}).")

    class Meta(RolloutSerializer.Meta):
        fields = [*RolloutSerializer.Meta.fields, "measurements"]
        read_only_fields = fields

    @extend_schema_field(MeasurementSerializer(many=True))
    def get_measurements(self, rollout: Rollout) -> list:
        latest = rollout.measurements.order_by("-taken_at", "-id")[:MAX_MEASUREMENTS]
        return MeasurementSerializer(latest, many=True).data


ACTION_RESPONSES = {200: RolloutDetailSerializer, **ROLLOUT_ERRORS, **ROLLOUT_CONFLICT}


def rollout_queryset():
    return Rollout.objects.select_related("deployment", "stable_version", "candidate_version", "created_by")


def get_rollout(name: str, rollout_id: int) -> Rollout:
    deployment = get_object_or_404(Deployment, name=name)
    return get_object_or_404(rollout_queryset(), deployment=deployment, pk=rollout_id)


def rollout_response(rollout: Rollout, code: int = status.HTTP_200_OK) -> Response:
    return Response(RolloutDetailSerializer(rollout_queryset().get(pk=rollout.pk)).data, status=code)


def validated(serializer_class, request) -> dict:
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


@extend_schema(tags=["rollouts"])
class RolloutListCreate(generics.ListAPIView):
    serializer_class = RolloutSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no URL kwargs
            return Rollout.objects.none()
        deployment = get_object_or_404(Deployment, name=self.kwargs["name"])
        queryset = rollout_queryset().filter(deployment=deployment).order_by("-id")
        if state := self.request.query_params.get("status"):
            queryset = queryset.filter(status=state)
        return queryset

    @extend_schema(parameters=[OpenApiParameter("status", OpenApiTypes.STR, enum=RolloutStatus.values)],
                   responses={200: RolloutSerializer(many=True), **ROLLOUT_ERRORS},
                   description="The deployment's rollouts, newest first.")
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(request=RolloutCreateSerializer,
                   responses={201: RolloutDetailSerializer, **ROLLOUT_ERRORS, **ROLLOUT_CONFLICT, **TOO_LARGE},
                   description="Start moving the deployment to a candidate (version, alias and/or engine_args). "
                               "Refused (409) while another rollout is active or an SLO's error budget is "
                               "exhausted, unless `rollback` is true or `override_reason` is given (audited).")
    def post(self, request, name: str):
        deployment = get_object_or_404(Deployment, name=name)
        data = validated(RolloutCreateSerializer, request)
        rollout = rollouts.rollout_create(deployment=deployment, actor=request.user, **data)
        return rollout_response(rollout, status.HTTP_201_CREATED)


@extend_schema(tags=["rollouts"])
class RolloutDetail(APIView):
    @extend_schema(responses={200: RolloutDetailSerializer, **ROLLOUT_ERRORS},
                   description="The rollout with its current step and weight, for CI to poll, and its measurements.")
    def get(self, request, name: str, rollout_id: int):
        return Response(RolloutDetailSerializer(get_rollout(name, rollout_id)).data)


@extend_schema(tags=["rollouts"])
class RolloutPromote(APIView):
    @extend_schema(request=PromoteSerializer, responses=ACTION_RESPONSES,
                   description="Go on to the next step now (ends a pause or an inconclusive analysis), or "
                               "with `full` skip every remaining step.")
    def post(self, request, name: str, rollout_id: int):
        rollout = get_rollout(name, rollout_id)
        data = validated(PromoteSerializer, request)
        return rollout_response(rollouts.rollout_promote(rollout=rollout, actor=request.user, **data))


@extend_schema(tags=["rollouts"])
class RolloutAbort(APIView):
    @extend_schema(request=AbortSerializer, responses=ACTION_RESPONSES,
                   description="Traffic back on the stable version at once; the candidate's replicas are drained.")
    def post(self, request, name: str, rollout_id: int):
        rollout = get_rollout(name, rollout_id)
        data = validated(AbortSerializer, request)
        return rollout_response(rollouts.rollout_abort(rollout=rollout, actor=request.user, **data))


@extend_schema(tags=["rollouts"])
class RolloutRetry(APIView):
    @extend_schema(request=RetrySerializer, responses=ACTION_RESPONSES,
                   description="Start an aborted rollout again from its first step.")
    def post(self, request, name: str, rollout_id: int):
        rollout = get_rollout(name, rollout_id)
        data = validated(RetrySerializer, request)
        return rollout_response(rollouts.rollout_retry(rollout=rollout, actor=request.user, **data))


@extend_schema(tags=["rollouts"])
class RolloutUndo(APIView):
    @extend_schema(
        request=UndoSerializer,
        responses={200: OpenApiResponse(RolloutDetailSerializer, description="The active rollout, now aborted."),
                   201: OpenApiResponse(RolloutDetailSerializer, description="A blue-green rollback rollout to "
                                        "the version and engine args before the last successful rollout."),
                   **ROLLOUT_ERRORS, **ROLLOUT_CONFLICT},
        description="Back to the previous version: aborts the active rollout if there is one, else rolls back "
                    "the last successful rollout (allowed while an error budget is exhausted).")
    def post(self, request, name: str):
        deployment = get_object_or_404(Deployment, name=name)
        validated(UndoSerializer, request)
        rollout = rollouts.rollout_undo(deployment=deployment, actor=request.user)
        created = rollout.status != RolloutStatus.ABORTED
        return rollout_response(rollout, status.HTTP_201_CREATED if created else status.HTTP_200_OK)
