"""REST API for eval runs: start one (202, a worker scores it), follow it, read its cases (the failing
ones first to read why), cancel it. For CI (`inferops eval run`), the console and the rollout step."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from evals.choices import RunStatus, TargetKind, Trigger
from evals.models import EvalCaseResult, EvalRun, EvalSet
from evals.runs import services
from inferops.api import CONFLICT, ERRORS, ErrorSerializer, RejectUnknownFields
from registry.models import ModelVersion

RUN_CONFLICT = {409: OpenApiResponse(ErrorSerializer, description="The run has already finished.")}
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def version_ref(version: ModelVersion | None) -> dict | None:
    return {"model": version.model.name, "version": version.number} if version else None


def run_target(run: EvalRun) -> dict:
    """The target in the shape it was asked for."""
    if run.target_kind == TargetKind.DEPLOYMENT:
        return {"deployment": run.deployment_name}
    if run.target_kind == TargetKind.ROLLOUT:
        return {"rollout": run.rollout_id, "track": run.track, "deployment": run.deployment_name}
    return version_ref(run.model_version)


def run_links(run: EvalRun) -> dict:
    return {
        "self": reverse("api-eval-run-detail", args=[run.pk]),
        "cases": reverse("api-eval-run-cases", args=[run.pk]),
        "failing_cases": reverse("api-eval-run-cases", args=[run.pk]) + "?passed=false",
        "cancel": reverse("api-eval-run-cancel", args=[run.pk]),
        "page": reverse("evals:run", args=[run.pk]),
    }


class EvalRunSerializer(serializers.ModelSerializer):
    eval_set = serializers.CharField(source="eval_set.name")
    set_version = serializers.IntegerField(source="set_version.number")
    target = serializers.SerializerMethodField(help_text=(
        '{"deployment": D}, {"model": M, "version": V} or {"rollout": ID, "track": "canary", "deployment": D}.'))
    model_version = serializers.SerializerMethodField(help_text="The version scored: {model, version}.")
    reference = serializers.SerializerMethodField(help_text="Parity's reference version: {model, version} or null.")
    progress = serializers.SerializerMethodField(help_text="{done, total} cases.")
    links = serializers.SerializerMethodField()

    class Meta:
        model = EvalRun
        fields = ["id", "eval_set", "set_version", "status", "progress", "target", "model_version", "engine_args",
                  "reference", "priority", "concurrency", "trigger", "cancel_requested", "scores", "score",
                  "prompt_tokens", "completion_tokens", "latency_ms", "usd", "error", "created_at", "started_at",
                  "finished_at", "links"]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_target(self, run) -> dict:
        return run_target(run)

    @extend_schema_field({"type": "object", "additionalProperties": {}, "nullable": True})
    def get_model_version(self, run) -> dict | None:
        return version_ref(run.model_version)

    @extend_schema_field({"type": "object", "additionalProperties": {}, "nullable": True})
    def get_reference(self, run) -> dict | None:
        return version_ref(run.reference_version)

    @extend_schema_field({"type": "object", "properties": {"done": {"type": "integer"}, "total": {"type": "integer"}}})
    def get_progress(self, run) -> dict:
        return {"done": run.done, "total": run.total}

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "string"}})
    def get_links(self, run) -> dict:
        return run_links(run)


class EvalCaseSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="case_id", help_text="The case's id in the eval set.")

    class Meta:
        model = EvalCaseResult
        fields = ["id", "index", "scorer", "output", "score", "passed", "reason", "detail", "prompt_tokens",
                  "completion_tokens", "latency_ms"]
        read_only_fields = fields


class ReferenceSerializer(RejectUnknownFields, serializers.Serializer):
    model = serializers.CharField(max_length=63)
    version = serializers.IntegerField(min_value=1)


@extend_schema_field({"type": "object", "example": {"deployment": "chat"}})
class TargetField(serializers.JSONField):
    """{"deployment": D} | {"model": M, "version": V} | {"rollout": ID, "track": "canary"}; checked by the service."""


class EvalRunCreateSerializer(RejectUnknownFields, serializers.Serializer):
    eval_set = serializers.CharField(max_length=63)
    set_version = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                           help_text="The set version's number; default the latest.")
    target = TargetField(help_text=services.TARGET_SHAPES + ". A model version runs on a temporary replica.")
    reference = ReferenceSerializer(required=False, allow_null=True, help_text=(
        "The version parity cases compare with (required when the set has parity cases)."))
    priority = serializers.IntegerField(required=False, allow_null=True, help_text=(
        f"Engine priority of its requests, {services.PRIORITY_RANGE[0]}..{services.PRIORITY_RANGE[1]}; default "
        "the lowest, so interactive traffic goes first (built-in engine only)."))
    concurrency = serializers.IntegerField(required=False, allow_null=True, help_text=(
        f"Requests at once, {services.CONCURRENCY_RANGE[0]}..{services.CONCURRENCY_RANGE[1]}; default "
        f"{services.DEFAULT_CONCURRENCY}."))

    def validate_eval_set(self, value: str) -> EvalSet:
        eval_set = EvalSet.objects.filter(name=value).first()
        if eval_set is None:
            raise serializers.ValidationError(f"No eval set named {value!r}.")
        return eval_set

    def validate_reference(self, value: dict | None) -> ModelVersion | None:
        if value is None:
            return None
        version = ModelVersion.objects.select_related("model").filter(
            model__name=value["model"], number=value["version"]).first()
        if version is None:
            raise serializers.ValidationError(f"Model {value['model']!r} has no version {value['version']}.")
        return version

    def validate(self, attrs):
        number = attrs.get("set_version")
        if number is not None:
            found = attrs["eval_set"].versions.filter(number=number).first()
            if found is None:
                raise serializers.ValidationError(
                    {"set_version": [f"Eval set {attrs['eval_set'].name!r} has no version {number}."]})
            attrs["set_version"] = found
        return attrs


def run_queryset():
    return EvalRun.objects.select_related("eval_set", "set_version", "model_version__model",
                                          "reference_version__model")


def bad_query(field: str, message: str) -> ValidationError:
    return ValidationError({field: [message]})


@extend_schema(tags=["evals"])
class EvalRunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # Reads need the viewer role; starting and cancelling the role that may change a deployment (operator).
    serializer_class = EvalRunSerializer
    lookup_url_kwarg = "run_id"

    def get_queryset(self):
        queryset = run_queryset()
        if self.action == "list":
            queryset = filter_runs(queryset, self.request.query_params)
        return queryset

    @extend_schema(parameters=[
        OpenApiParameter("eval_set", OpenApiTypes.STR), OpenApiParameter("status", OpenApiTypes.STR,
                                                                         enum=RunStatus.values),
        OpenApiParameter("model", OpenApiTypes.STR, description="The scored version's model (with `version`)."),
        OpenApiParameter("version", OpenApiTypes.INT, description="The scored version's number; needs `model`."),
        OpenApiParameter("deployment", OpenApiTypes.STR, description="Runs on this deployment or its rollouts."),
    ], responses={200: EvalRunSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=EvalRunCreateSerializer, responses={202: EvalRunSerializer, **ERRORS})
    def create(self, request):
        serializer = EvalRunCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        run = services.run_create(
            eval_set=data["eval_set"], actor=request.user, target=data["target"],
            set_version=data.get("set_version"), reference=data.get("reference"), priority=data.get("priority"),
            concurrency=data.get("concurrency"), trigger=Trigger.API)
        return Response(EvalRunSerializer(run_queryset().get(pk=run.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses={200: EvalRunSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(parameters=[OpenApiParameter("passed", OpenApiTypes.BOOL,
                                                description="false: the failing cases only; true: the passing.")],
                   responses={200: EvalCaseSerializer(many=True), **ERRORS})
    @action(detail=True, methods=["get"])
    def cases(self, request, run_id: int):
        run = self.get_object()
        cases = run.cases.order_by("index")
        passed = request.query_params.get("passed")
        if passed is not None:
            if passed.lower() not in BOOLEANS:
                raise bad_query("passed", "Must be true or false.")
            cases = cases.filter(passed=BOOLEANS[passed.lower()])
        page = self.paginate_queryset(cases)
        return self.get_paginated_response(EvalCaseSerializer(page, many=True).data)

    @extend_schema(request=None, responses={200: EvalRunSerializer, **ERRORS, **CONFLICT, **RUN_CONFLICT},
                   description="A queued run is cancelled at once; a running one stops after the cases in flight.")
    @action(detail=True, methods=["post"])
    def cancel(self, request, run_id: int):
        run = services.run_cancel(run=self.get_object(), actor=request.user)
        return Response(EvalRunSerializer(run_queryset().get(pk=run.pk)).data)


def filter_runs(queryset, params):
    """The list's filters; a bad value is a 400 naming its parameter."""
    if name := params.get("eval_set"):
        queryset = queryset.filter(eval_set__name=name)
    if state := params.get("status"):
        if state not in RunStatus.values:
            raise bad_query("status", f"One of: {', '.join(RunStatus.values)}.")
        queryset = queryset.filter(status=state)
    model, version = params.get("model"), params.get("version")
    if version is not None:
        if not model:
            raise bad_query("version", "Give model too: a version number is per model.")
        if not version.isdigit():
            raise bad_query("version", "Must be a version number.")
        queryset = queryset.filter(model_version__number=int(version))
    if model:
        queryset = queryset.filter(model_version__model__name=model)
    if deployment := params.get("deployment"):
        queryset = queryset.filter(deployment_name=deployment)
    return queryset


def get_run(run_id: int) -> EvalRun:
    return get_object_or_404(run_queryset(), pk=run_id)
