"""REST API for deployments: CRUD, replicas, and metrics series for CI and the console (rollouts:
deployments/rollouts/api.py)."""

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

from deployments import services
from deployments.choices import Backend, DriverName, ReplicaState
from deployments.models import Deployment, Replica, ReplicaStart
from deployments.replicas import cold_start
from inferops.api import CONFLICT, ERRORS, TOO_LARGE, ErrorSerializer, query_step, query_time
from inferops.validators import slug_validator
from registry.models import RegisteredModel

SERIES_UNITS = {
    "requests_per_s": "requests/s", "output_tokens_per_s": "tokens/s", "ttft_p50": "ms", "ttft_p95": "ms",
    "ttft_p99": "ms", "itl_p95": "ms", "kv_cache_usage": "fraction", "queue_depth": "requests",
    # GPU telemetry (null points where no replica reported GPU series) and model FLOPs utilisation.
    "gpu_utilization": "fraction", "gpu_memory_used": "MiB", "gpu_memory_total": "MiB", "mfu": "fraction",
    # The built-in engine's SLO scheduling (docs/serving.md); null points where no replica exports them.
    **{f"slo_{key}_per_s": "requests/s" for key in ("judged", "missed_ttft", "missed_tpot", "rejected_late",
                                                   "served_late")},
}
SERIES = list(SERIES_UNITS)
# Series read from the usage ledger rather than the replicas' scraped metrics.
LEDGER_SERIES = {"error_rate": "fraction"}
MAX_POINTS = 5000


class PhaseSecondsSerializer(serializers.Serializer):
    # Seconds from the start request to the end of each phase; null: not reached, or not reported (vLLM
    # reports no weights_loaded nor first_token).
    process = serializers.FloatField(allow_null=True, help_text="The serving process is up.")
    weights_loaded = serializers.FloatField(allow_null=True, help_text="Its weights are loaded.")
    ready = serializers.FloatField(allow_null=True, help_text="/health answered 200 to the reconcile loop.")
    first_token = serializers.FloatField(allow_null=True, help_text="Its first generated token (or embedding) left.")


class LatestStartSerializer(serializers.Serializer):
    cause = serializers.CharField(read_only=True, help_text=(
        "scale (one more beside ready ones), restart (replacing a failed one) or from_zero (none of the "
        "deployment's replicas was ready)."))
    started_at = serializers.DateTimeField(
        read_only=True, help_text="When the reconcile loop asked the driver for the process.")
    seconds = serializers.SerializerMethodField()

    @extend_schema_field(PhaseSecondsSerializer)
    def get_seconds(self, start) -> dict:
        return cold_start.rounded(start)


class ColdStartSerializer(LatestStartSerializer, serializers.ModelSerializer):
    replica = serializers.IntegerField(source="replica_id", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)

    class Meta:
        model = ReplicaStart
        fields = ["id", "replica", "version", "cause", "started_at", "failed", "seconds"]
        read_only_fields = fields


class PhaseSummarySerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Starts that did not fail and reached (or reported) the phase.")
    median = serializers.FloatField(allow_null=True)
    max = serializers.FloatField(allow_null=True)


class ReplicaSerializer(serializers.ModelSerializer):
    version = serializers.IntegerField(source="version.number")
    cold_start = serializers.SerializerMethodField(
        help_text="The replica's latest start and what each phase of it took; null before any start.")

    class Meta:
        model = Replica
        fields = ["id", "version", "state", "url", "restarts", "crash_looping", "started_at", "ready_at",
                  "last_health_at", "last_health_ok", "last_error", "node", "driver", "cold_start"]
        read_only_fields = fields

    @extend_schema_field(LatestStartSerializer(allow_null=True))
    def get_cold_start(self, replica) -> dict | None:
        latest = self.context.get("latest_starts")
        start = latest.get(replica.pk) if latest is not None else cold_start.latest_start(replica)
        return LatestStartSerializer(start).data if start is not None else None


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
class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Deployments (CRUD), and per deployment its replicas and its metrics series.
    serializer_class = DeploymentSerializer
    lookup_field = "name"

    def get_queryset(self):
        queryset = deployment_queryset()
        if self.action == "list":
            if model := self.request.query_params.get("model"):
                queryset = queryset.filter(model__name=model)
            if state := self.request.query_params.get("status"):
                queryset = queryset.filter(status=state)
        return queryset

    @extend_schema(parameters=[OpenApiParameter("model", OpenApiTypes.STR),
                               OpenApiParameter("status", OpenApiTypes.STR)],
                   responses={200: DeploymentSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=DeploymentCreateSerializer,
                   responses={201: DeploymentSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request):
        serializer = DeploymentCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        deployment = services.deployment_create(actor=request.user, **data)
        return Response(DeploymentSerializer(get_deployment(deployment.name)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: DeploymentSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=DeploymentUpdateSerializer, responses={
        200: DeploymentSerializer, **ERRORS,
        409: OpenApiResponse(ErrorSerializer, description="A rollout is progressing: the version and engine args "
                                                          "change through it (promote or abort it first).")})
    def partial_update(self, request, name: str):
        deployment = self.get_object()
        serializer = DeploymentUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.deployment_update(deployment=deployment, actor=request.user, **serializer.validated_data)
        return Response(DeploymentSerializer(get_deployment(name)).data)

    @extend_schema(responses={202: DeploymentSerializer, **ERRORS},
                   description="Drains and stops every replica, then removes the deployment.")
    def destroy(self, request, *args, **kwargs):
        deployment = services.deployment_delete(deployment=self.get_object(), actor=request.user)
        return Response(DeploymentSerializer(get_deployment(deployment.name)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[OpenApiParameter("all", OpenApiTypes.BOOL,
                                                description="Include stopped replicas.")],
                   responses={200: ReplicaSerializer(many=True), **ERRORS})
    @action(detail=True, methods=["get"])
    def replicas(self, request, name: str):
        deployment = self.get_object()
        replicas = deployment.replica_set.select_related("version").order_by("id")
        if request.query_params.get("all") not in ("1", "true"):
            replicas = replicas.exclude(state=ReplicaState.STOPPED)
        replicas = list(replicas)
        latest = cold_start.latest_starts(r.pk for r in replicas)
        return Response(ReplicaSerializer(replicas, many=True, context={"latest_starts": latest}).data)

    @extend_schema(
        parameters=[OpenApiParameter("limit", OpenApiTypes.INT, description="Starts a page (default 50)."),
                    OpenApiParameter("offset", OpenApiTypes.INT, description="Starts to skip.")],
        responses={200: inline_serializer("ColdStartPage", {
            "count": serializers.IntegerField(), "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True), "results": ColdStartSerializer(many=True),
            "summary": inline_serializer("ColdStartSummary", {
                phase: PhaseSummarySerializer() for phase in cold_start.PHASES},
                help_text="Median and max seconds of each phase over this page's starts."),
        }), **ERRORS},
        description="The deployment's replica starts, newest first, with the seconds each phase of the cold "
                    "start took, and their median and max over the page.")
    @action(detail=True, methods=["get"], url_path="cold-starts")
    def cold_starts(self, request, name: str):
        deployment = self.get_object()
        starts = deployment.replica_starts.select_related("version").order_by("-started_at", "-id")
        page = self.paginate_queryset(starts)
        response = self.get_paginated_response(ColdStartSerializer(page, many=True).data)
        response.data["summary"] = cold_start.summary(page)
        return response

    @extend_schema(
        parameters=[
            OpenApiParameter("series", OpenApiTypes.STR, enum=[*SERIES, *LEDGER_SERIES], required=True,
                             description="error_rate: server failures / requests over every request of the "
                                         "deployment (shed ones included), with per-track rates during rollouts"),
            OpenApiParameter("start", OpenApiTypes.STR, description="ISO 8601 or Unix time; default end - 1h"),
            OpenApiParameter("end", OpenApiTypes.STR, description="ISO 8601 or Unix time; default now"),
            OpenApiParameter("step", OpenApiTypes.STR, description="seconds or 30s/5m/1h; default 60s"),
            OpenApiParameter("version", OpenApiTypes.INT, description="only this version's replicas"),
            OpenApiParameter("events", OpenApiTypes.BOOL, description="also list the deployment's events in the "
                             "range (deploys, rollouts, replica restarts, alerts) for chart markers"),
        ],
        responses={200: inline_serializer("MetricsSeries", {
            "series": serializers.CharField(), "unit": serializers.CharField(),
            "points": serializers.ListField(child=serializers.ListField()),
            "counts": serializers.ListField(child=serializers.ListField(), required=False,
                                            help_text="error_rate: [time, requests, failed, failed before a replica]"),
            "tracks": serializers.DictField(child=serializers.ListField(), required=False,
                                            help_text="error_rate: stable / candidate points while rollouts ran"),
            "events": serializers.ListField(child=inline_serializer("MetricsEvent", {
                "at": serializers.DateTimeField(), "kind": serializers.CharField(), "text": serializers.CharField(),
            }), required=False),
        }), **ERRORS},
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request, name: str):
        from deployments.replicas.metrics_query import deployment_error_rate, deployment_events, deployment_series

        deployment = self.get_object()
        params = request.query_params
        series = params.get("series")
        if series not in SERIES and series not in LEDGER_SERIES:
            return Response({"series": [f"One of: {', '.join([*SERIES, *LEDGER_SERIES])}."]},
                            status=status.HTTP_400_BAD_REQUEST)
        end = query_time(params.get("end"), "end", timezone.now())
        start = query_time(params.get("start"), "start", end - timedelta(hours=1))
        step = query_step(params.get("step"))
        if start >= end:
            return Response({"start": ["start must be before end."]}, status=status.HTTP_400_BAD_REQUEST)
        if (end - start).total_seconds() / step > MAX_POINTS:
            return Response({"step": [f"More than {MAX_POINTS} points; use a larger step."]},
                            status=status.HTTP_400_BAD_REQUEST)
        version = params.get("version")
        if version is not None and not version.isdigit():
            return Response({"version": ["Must be a version number."]}, status=status.HTTP_400_BAD_REQUEST)
        events = params.get("events", "").lower()
        if events not in ("", "0", "1", "true", "false"):
            return Response({"events": ["Must be true or false."]}, status=status.HTTP_400_BAD_REQUEST)
        if series in LEDGER_SERIES:
            if version is not None:
                return Response({"version": ["error_rate is per rollout track (see `tracks`), not per version."]},
                                status=status.HTTP_400_BAD_REQUEST)
            body = {"series": series, "unit": LEDGER_SERIES[series],
                    **deployment_error_rate(deployment, start, end, step)}
        else:
            points = deployment_series(deployment, series, start, end, step,
                                       version=int(version) if version else None)
            body = {"series": series, "unit": SERIES_UNITS[series], "points": points}
        if events in ("1", "true"):
            body["events"] = deployment_events(deployment, start, end)
        return Response(body)
