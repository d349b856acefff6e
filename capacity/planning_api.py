"""REST API of capacity planning (mounted at /api/v1/): goodput curves, capacity runs and the plan.

    POST/GET  capacity/curves/                         store a curve (`inferops bench --save-curve`), list them
    GET       capacity/curves/{id}/                    one curve
    POST/GET  deployments/{name}/capacity-runs/        measure one replica of the deployment, list its runs
    GET       deployments/{name}/capacity-runs/{id}/   one run, where it stands
    GET       capacity/plan/?deployment=D&rps=20       replicas and money for a rate (or model, version, hardware)

And the console's button that starts a capacity run from the deployment page (mounted at /capacity/).
"""

from __future__ import annotations

import math

from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from capacity import runs
from capacity.choices import CurveSource
from capacity.curves import curve_create, deployment_hardware, validate_hardware
from capacity.models import CapacityCurve, CapacityRun
from capacity.planner import DEFAULT_HEADROOM, MAX_HEADROOM, PlanError, plan_for_deployment, plan_for_version
from deployments.models import Deployment
from inferops.api import ERRORS, ErrorSerializer, PlainMetadata, RejectUnknownFields
from registry.models import ModelVersion
from runtime.goodput import MAX_CURVE_STEPS, SLO_METRICS

MAX_PLAN_RPS = 1_000_000.0
MAX_TOKENS = 1_000_000
RUN_CONFLICT = {409: OpenApiResponse(ErrorSerializer, description=(
    "Another capacity run of the deployment is queued or running, or no replica of it is ready."))}
NOT_FOUND = {404: OpenApiResponse(ErrorSerializer, description="Unknown deployment or run.")}


class NumberField(serializers.FloatField):
    """A finite number: `true`, NaN and infinities are refused (DRF's FloatField takes all three)."""

    def to_internal_value(self, data):
        if isinstance(data, bool):
            self.fail("invalid")
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            self.fail("invalid")
        return value


class BoundedListField(serializers.ListField):
    """A list whose length is checked before its items: 10,000 bad items are one error, not 10,000."""

    def to_internal_value(self, data):
        if isinstance(data, list) and self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


def _above_zero(value: float) -> None:
    if not value > 0:
        raise serializers.ValidationError("Must be more than 0.")


# ---------------------------------------------------------------------------- curves


class CapacityCurvePointSerializer(RejectUnknownFields, serializers.Serializer):
    rps = NumberField(validators=[_above_zero], help_text="The offered rate of the step, req/s.")
    throughput_rps = NumberField(min_value=0, help_text="Requests completed per second.")
    goodput_rps = NumberField(min_value=0, required=False, allow_null=True, default=None,
                              help_text="Requests per second that met every `slo_ms` threshold; null: not counted.")
    ttft_p95_ms = NumberField(min_value=0, allow_null=True, help_text="Null only when no request completed.")
    tpot_p95_ms = NumberField(min_value=0, required=False, allow_null=True, default=None,
                              help_text="Null when no answer had more than one token.")
    completed = serializers.IntegerField(min_value=0)
    failed = serializers.IntegerField(min_value=0)
    sent_rps = NumberField(required=False, allow_null=True, default=None, validators=[_above_zero],
                           help_text="The rate the step actually sent (Poisson arrivals stray from the offered).")

    def validate(self, attrs):
        if attrs["completed"] and attrs["ttft_p95_ms"] is None:
            raise serializers.ValidationError({"ttft_p95_ms": ["Requests completed: give their TTFT p95."]})
        goodput = attrs.get("goodput_rps")
        if goodput is not None and goodput > attrs["throughput_rps"] * (1 + 1e-9):
            raise serializers.ValidationError({"goodput_rps": ["Cannot exceed throughput_rps: good requests are "
                                                               "completed ones."]})
        if attrs.get("sent_rps") is None:
            attrs.pop("sent_rps", None)
        return attrs


def validate_slo_ms(value) -> dict:
    if not isinstance(value, dict):
        raise serializers.ValidationError("An object such as {\"ttft\": 500, \"tpot\": 50}.")
    unknown = sorted(set(value) - set(SLO_METRICS))
    if unknown:
        raise serializers.ValidationError(f"Unknown metric {unknown[0]!r}; use {', '.join(SLO_METRICS)}.")
    for name, limit in value.items():
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not math.isfinite(limit) or limit <= 0:
            raise serializers.ValidationError(f"{name}: a positive number of milliseconds.")
    return {name: float(limit) for name, limit in value.items()}


class CapacityCurveCreateSerializer(RejectUnknownFields, serializers.Serializer):
    deployment = serializers.CharField(max_length=63, required=False, help_text=(
        "Measured on a replica of this deployment: the curve takes its version, hardware and engine arguments."))
    model = serializers.CharField(max_length=63, required=False, help_text="Without deployment: the model, ...")
    version = serializers.IntegerField(min_value=1, required=False, help_text="... its version number, ...")
    hardware = serializers.CharField(max_length=200, required=False, help_text=(
        "... and the hardware (gpu:H100x1, cpu:4, as the planner names a deployment's)."))
    engine_args = serializers.DictField(required=False, help_text="With model: the engine arguments measured at.")
    input_len = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, help_text="Prompt tokens per request.")
    output_len = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, help_text="Output tokens per request.")
    slo_ms = serializers.JSONField(required=False, default=dict, validators=[validate_slo_ms], help_text=(
        "The thresholds goodput was counted against, ms: {ttft, tpot, e2el}."))
    points = CapacityCurvePointSerializer(many=True, min_length=1, max_length=MAX_CURVE_STEPS,
                                          help_text="One per step, by rising rps.")

    def validate_deployment(self, value: str) -> Deployment:
        deployment = Deployment.objects.select_related("model", "version").filter(
            name=value, deleted_at__isnull=True).first()
        if deployment is None:
            raise serializers.ValidationError(f"No deployment named {value!r}.")
        return deployment

    def validate_points(self, points: list[dict]) -> list[dict]:
        rates = [point["rps"] for point in points]
        if any(later <= earlier for earlier, later in zip(rates, rates[1:], strict=False)):
            raise serializers.ValidationError("The points' rps must rise from one point to the next.")
        return points

    def validate_hardware(self, value: str) -> str:
        if problem := validate_hardware(value):
            raise serializers.ValidationError(problem)
        return value

    def validate(self, attrs):
        by_version = [name for name in ("model", "version", "hardware", "engine_args") if name in attrs]
        if "deployment" in attrs:
            if by_version:
                raise serializers.ValidationError({name: ["Give deployment or model, version and hardware, not both."]
                                                   for name in by_version})
            deployment = attrs.pop("deployment")
            attrs.update(version=deployment.version, hardware=deployment_hardware(deployment),
                         engine_args=deployment.engine_args, deployment=deployment.name)
            return attrs
        missing = [name for name in ("model", "version", "hardware") if name not in attrs]
        if missing:
            raise serializers.ValidationError({name: ["Give deployment, or model, version and hardware."]
                                               for name in missing})
        version = ModelVersion.objects.select_related("model").filter(
            model__name=attrs.pop("model"), number=attrs["version"]).first()
        if version is None:
            raise serializers.ValidationError({"version": ["No such version of that model."]})
        attrs.update(version=version, engine_args=attrs.get("engine_args", {}), deployment="")
        return attrs


class CapacityCurveSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="version.model.name")
    version = serializers.IntegerField(source="version.number")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    points = serializers.JSONField(help_text=(
        "[{rps, throughput_rps, goodput_rps, ttft_p95_ms, tpot_p95_ms, completed, failed, sent_rps?}] by rising rps."))

    class Meta:
        model = CapacityCurve
        fields = ["id", "model", "version", "hardware", "engine_args", "deployment", "source", "input_len",
                  "output_len", "slo_ms", "points", "created_at", "created_by"]
        read_only_fields = fields


def curve_queryset():
    return CapacityCurve.objects.select_related("version__model", "created_by")


def filter_curves(queryset, params):
    model, version = params.get("model"), params.get("version")
    if version is not None:
        if not version.isdigit():
            raise serializers.ValidationError({"version": ["A version number."]})
        if not model:
            raise serializers.ValidationError({"version": ["Give model too: a version number is per model."]})
        queryset = queryset.filter(version__number=int(version))
    if model:
        queryset = queryset.filter(version__model__name=model)
    if hardware := params.get("hardware"):
        queryset = queryset.filter(hardware=hardware)
    if deployment := params.get("deployment"):
        queryset = queryset.filter(deployment=deployment)
    if source := params.get("source"):
        if source not in CurveSource.values:
            raise serializers.ValidationError({"source": [f"One of: {', '.join(CurveSource.values)}."]})
        queryset = queryset.filter(source=source)
    return queryset


@extend_schema(tags=["capacity"])
class CapacityCurveViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Goodput curves: stored by `inferops bench --save-curve` and by capacity runs, read by the planner.
    serializer_class = CapacityCurveSerializer
    metadata_class = PlainMetadata

    def get_queryset(self):
        queryset = curve_queryset()
        return filter_curves(queryset, self.request.query_params) if self.action == "list" else queryset

    @extend_schema(parameters=[
        OpenApiParameter("model", OpenApiTypes.STR), OpenApiParameter("version", OpenApiTypes.INT,
                                                                      description="A version number; needs model."),
        OpenApiParameter("hardware", OpenApiTypes.STR, description="e.g. gpu:H100x1, cpu:4"),
        OpenApiParameter("deployment", OpenApiTypes.STR, description="Measured on this deployment."),
        OpenApiParameter("source", OpenApiTypes.STR, enum=CurveSource.values),
    ], responses={200: CapacityCurveSerializer(many=True), **ERRORS}, summary="Goodput curves, newest first")
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: CapacityCurveSerializer, **ERRORS}, summary="One goodput curve")
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=CapacityCurveCreateSerializer, responses={201: CapacityCurveSerializer, **ERRORS},
                   summary="Store a goodput curve measured by `inferops bench --rates`")
    def create(self, request):
        serializer = CapacityCurveCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        curve = curve_create(version=data["version"], hardware=data["hardware"], engine_args=data["engine_args"],
                             deployment=data["deployment"], source=CurveSource.BENCH, input_len=data["input_len"],
                             output_len=data["output_len"], slo_ms=data["slo_ms"],
                             points=[dict(point) for point in data["points"]], actor=request.user)
        return Response(CapacityCurveSerializer(curve_queryset().get(pk=curve.pk)).data, status=status.HTTP_201_CREATED)


# ---------------------------------------------------------------------------- capacity runs


class CapacityRunCreateSerializer(RejectUnknownFields, serializers.Serializer):
    rates = BoundedListField(
        child=NumberField(validators=[_above_zero], max_value=runs.MAX_RATE), required=False,
        min_length=1, max_length=runs.MAX_STEPS,
        help_text=f"Offered req/s of each step, rising; default {list(runs.DEFAULT_RATES)}, at most "
                  f"{runs.MAX_STEPS} steps of at most {runs.MAX_RATE:g} req/s.")
    step_s = NumberField(required=False, min_value=runs.STEP_S_RANGE[0], max_value=runs.STEP_S_RANGE[1],
                         help_text=f"Seconds of arrivals per step, {runs.STEP_S_RANGE[0]:g} to "
                                   f"{runs.STEP_S_RANGE[1]:g}; default {runs.DEFAULT_STEP_S:g}.")
    input_len = serializers.IntegerField(required=False, min_value=1, max_value=MAX_TOKENS, help_text=(
        f"Prompt tokens per request; default {runs.DEFAULT_INPUT_LEN} (less where the context is shorter)."))
    output_len = serializers.IntegerField(required=False, min_value=1, max_value=MAX_TOKENS, help_text=(
        f"Output tokens per request; default {runs.DEFAULT_OUTPUT_LEN} (less where the context is shorter)."))

    def validate_rates(self, value: list[float]) -> list[float]:
        if any(later <= earlier for earlier, later in zip(value, value[1:], strict=False)):
            raise serializers.ValidationError("Rates must rise from step to step, e.g. [1, 2, 4, 8].")
        return value

    def validate(self, attrs):
        context = self.context["deployment"].version.max_context or 0
        attrs.setdefault("rates", list(runs.DEFAULT_RATES))
        attrs.setdefault("step_s", runs.DEFAULT_STEP_S)
        if context:
            attrs.setdefault("input_len", min(runs.DEFAULT_INPUT_LEN, context // 2))
            attrs.setdefault("output_len", min(runs.DEFAULT_OUTPUT_LEN, max(1, context // 4)))
            if attrs["input_len"] + attrs["output_len"] > context:
                raise serializers.ValidationError({"input_len": [
                    f"input_len + output_len is {attrs['input_len'] + attrs['output_len']}, past the version's "
                    f"context of {context} tokens."]})
        attrs.setdefault("input_len", runs.DEFAULT_INPUT_LEN)
        attrs.setdefault("output_len", runs.DEFAULT_OUTPUT_LEN)
        return attrs


class CapacityRunSerializer(serializers.ModelSerializer):
    deployment = serializers.CharField(source="deployment.name")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    estimated_finish_at = serializers.SerializerMethodField(help_text="When a running run should end; else null.")
    links = serializers.SerializerMethodField()

    class Meta:
        model = CapacityRun
        fields = ["id", "deployment", "status", "rates", "step_s", "input_len", "output_len", "curve", "error",
                  "created_at", "started_at", "estimated_finish_at", "finished_at", "created_by", "links"]
        read_only_fields = fields

    @extend_schema_field({"type": "string", "format": "date-time", "nullable": True})
    def get_estimated_finish_at(self, run):
        finish = runs.estimated_finish(run) if run.status == "running" else None
        return None if finish is None else serializers.DateTimeField().to_representation(finish)

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "string"}})
    def get_links(self, run) -> dict:
        name = run.deployment.name
        links = {"self": reverse("api-capacity-run", args=[name, run.pk])}
        if run.curve_id:
            links["curve"] = reverse("api-capacity-curve", args=[run.curve_id])
        return links


def _deployment(name: str) -> Deployment:
    return get_object_or_404(Deployment.objects.select_related("model", "version"), name=name,
                             deleted_at__isnull=True)


@extend_schema(tags=["capacity"])
class CapacityRunViewSet(viewsets.GenericViewSet):
    # A deployment's capacity runs: a short stepped-rate benchmark of one of its replicas, stored as a curve.
    metadata_class = PlainMetadata
    serializer_class = CapacityRunSerializer

    def get_queryset(self):
        return CapacityRun.objects.select_related("deployment", "created_by")

    @extend_schema(responses={200: CapacityRunSerializer(many=True), **ERRORS, **NOT_FOUND},
                   summary="A deployment's capacity runs, newest first")
    def list(self, request, name: str):
        runs_of = self.get_queryset().filter(deployment=_deployment(name))
        page = self.paginate_queryset(runs_of)
        return self.get_paginated_response(CapacityRunSerializer(page, many=True).data)

    @extend_schema(request=CapacityRunCreateSerializer, responses={202: CapacityRunSerializer, **ERRORS, **NOT_FOUND,
                                                                   **RUN_CONFLICT},
                   summary="Measure one replica of a deployment at stepped rates (lowest priority), store its curve")
    def create(self, request, name: str):
        deployment = _deployment(name)
        serializer = CapacityRunCreateSerializer(data=request.data, context={"deployment": deployment})
        serializer.is_valid(raise_exception=True)
        run = runs.capacity_run_create(deployment=deployment, actor=request.user, **serializer.validated_data)
        return Response(CapacityRunSerializer(self.get_queryset().get(pk=run.pk)).data,
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: CapacityRunSerializer, **ERRORS, **NOT_FOUND}, summary="One capacity run")
    def retrieve(self, request, name: str, run_id: int):
        run = get_object_or_404(self.get_queryset(), deployment=_deployment(name), pk=run_id)
        return Response(CapacityRunSerializer(run).data)


# ---------------------------------------------------------------------------- the plan


class CapacityPlanQuerySerializer(serializers.Serializer):
    deployment = serializers.CharField(max_length=63, required=False)
    model = serializers.CharField(max_length=63, required=False)
    version = serializers.IntegerField(min_value=1, required=False)
    hardware = serializers.CharField(max_length=200, required=False)
    rps = NumberField(min_value=0, max_value=MAX_PLAN_RPS)
    headroom = NumberField(min_value=0, max_value=MAX_HEADROOM, required=False, default=DEFAULT_HEADROOM)

    def validate(self, attrs):
        by_version = [name for name in ("model", "version", "hardware") if name in attrs]
        if "deployment" in attrs:
            if by_version:
                raise serializers.ValidationError({name: ["Give deployment or model, version and hardware, not both."]
                                                   for name in by_version})
            deployment = Deployment.objects.select_related("model", "version").filter(
                name=attrs["deployment"], deleted_at__isnull=True).first()
            if deployment is None:
                raise serializers.ValidationError({"deployment": [f"No deployment named {attrs['deployment']!r}."]})
            attrs["deployment"] = deployment
            return attrs
        missing = [name for name in ("model", "version", "hardware") if name not in attrs]
        if len(missing) == 3:
            raise serializers.ValidationError({"deployment": ["Give deployment, or model, version and hardware."]})
        if missing:
            raise serializers.ValidationError({name: ["Give it with the others, or deployment alone."]
                                               for name in missing})
        version = ModelVersion.objects.select_related("model").filter(
            model__name=attrs["model"], number=attrs["version"]).first()
        if version is None:
            raise serializers.ValidationError({"version": [f"Model {attrs['model']!r} has no version "
                                                           f"{attrs['version']}."]})
        attrs["version"] = version
        return attrs


class CapacityPlanCurveSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    age_s = serializers.FloatField(help_text="Seconds since it was measured.")
    source = serializers.ChoiceField(choices=CurveSource.choices)
    deployment = serializers.CharField(help_text="Where it was measured; empty when stored by version.")
    hardware = serializers.CharField()
    engine_args = serializers.DictField()
    same_engine_args = serializers.BooleanField(help_text="false: measured at other engine arguments (a fallback).")
    input_len = serializers.IntegerField()
    output_len = serializers.IntegerField()
    slo_ms = serializers.DictField(help_text="The thresholds its goodput was counted against.")
    points = serializers.JSONField()


class CapacityPlanSloSerializer(serializers.Serializer):
    ttft_ms = serializers.FloatField(allow_null=True)
    tpot_ms = serializers.FloatField(allow_null=True)
    objective = serializers.FloatField(allow_null=True)


def _money(help_text: str):
    return serializers.DecimalField(max_digits=30, decimal_places=6, allow_null=True, help_text=help_text)


class CapacityPlanSerializer(serializers.Serializer):
    deployment = serializers.CharField(allow_null=True)
    model = serializers.CharField()
    version = serializers.IntegerField()
    hardware = serializers.CharField()
    engine_args = serializers.DictField()
    rps = serializers.FloatField(help_text="The rate planned for, req/s.")
    headroom = serializers.FloatField(help_text="The share of each replica's capacity kept free.")
    replicas = serializers.IntegerField(help_text="ceil(rps / (capacity_rps_per_replica × (1 − headroom))).")
    capacity_rps_per_replica = serializers.FloatField(help_text="What one replica serves within the SLOs.")
    usable_rps_per_replica = serializers.FloatField(help_text="capacity × (1 − headroom).")
    utilization = serializers.FloatField(help_text="rps / (replicas × capacity).")
    capacity_method = serializers.ChoiceField(choices=["slo", "throughput-knee"])
    limited_by = serializers.CharField(allow_null=True, help_text=(
        "What ended the capacity: ttft_p95, tpot_p95, goodput, failed or throughput; null: nothing within the "
        "curve's rates."))
    slo = CapacityPlanSloSerializer(help_text="The targets and objective judged against.")
    goodput_judged = serializers.BooleanField(help_text="Whether the curve's goodput counted (its thresholds were "
                                                        "at least as tight as the SLOs').")
    usd_per_replica_hour = _money("One replica-hour at the price book's prices now; null: nothing priced.")
    usd_per_hour = _money("replicas × usd_per_replica_hour.")
    usd_per_month = _money("usd_per_hour × 730.")
    usd_per_mtok = _money("usd_per_hour per million tokens served at rps (the curve's input + output lengths).")
    tokens_per_hour = serializers.FloatField()
    curve = CapacityPlanCurveSerializer(help_text="The curve the plan rests on.")
    warnings = serializers.ListField(child=serializers.CharField())


def plan_of(params) -> dict:
    """The plan for the query (CapacityPlanQuerySerializer's fields); a 400 naming what is wrong."""
    query = CapacityPlanQuerySerializer(data=params)
    query.is_valid(raise_exception=True)
    data = query.validated_data
    try:
        if "deployment" in data:
            return plan_for_deployment(data["deployment"], data["rps"], data["headroom"])
        return plan_for_version(data["version"], data["hardware"], data["rps"], data["headroom"])
    except PlanError as exc:
        raise serializers.ValidationError({"detail": str(exc)}) from None


@extend_schema(tags=["capacity"])
class CapacityPlanViewSet(viewsets.GenericViewSet):
    # Replicas needed for a request rate within the SLOs, and what they cost, from the newest goodput curve.
    metadata_class = PlainMetadata

    @extend_schema(parameters=[
        OpenApiParameter("deployment", OpenApiTypes.STR, description="Plan for this deployment (its version, "
                                                                     "hardware, engine arguments and SLOs) ..."),
        OpenApiParameter("model", OpenApiTypes.STR, description="... or for this model's version ..."),
        OpenApiParameter("version", OpenApiTypes.INT, description="... (its number) ..."),
        OpenApiParameter("hardware", OpenApiTypes.STR, description="... on this hardware (gpu:H100x1, cpu:4)."),
        OpenApiParameter("rps", OpenApiTypes.NUMBER, required=True, description="Requests per second to serve."),
        OpenApiParameter("headroom", OpenApiTypes.NUMBER, description=(
            f"Share of each replica's capacity kept free, 0 to {MAX_HEADROOM:g}; default {DEFAULT_HEADROOM:g}.")),
    ], responses={200: CapacityPlanSerializer, **ERRORS}, summary="Replicas and cost to serve a request rate")
    def retrieve(self, request):
        return Response(CapacityPlanSerializer(plan_of(request.query_params)).data)


urlpatterns = [
    path("capacity/curves/", CapacityCurveViewSet.as_view({"get": "list", "post": "create"}),
         name="api-capacity-curves"),
    path("capacity/curves/<int:pk>/", CapacityCurveViewSet.as_view({"get": "retrieve"}), name="api-capacity-curve"),
    path("capacity/plan/", CapacityPlanViewSet.as_view({"get": "retrieve"}), name="api-capacity-plan"),
    path("deployments/<str:name>/capacity-runs/", CapacityRunViewSet.as_view({"get": "list", "post": "create"}),
         name="api-capacity-runs"),
    path("deployments/<str:name>/capacity-runs/<int:run_id>/", CapacityRunViewSet.as_view({"get": "retrieve"}),
         name="api-capacity-run"),
]
