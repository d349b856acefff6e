"""REST API for progressive rollouts: start one, follow it (through its watch after success), promote,
abort, retry, undo, turn its automatic rollback on or off (for CI and the `inferops rollout` CLI)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from deployments.choices import RolloutStatus, Strategy, Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts import services as rollouts
from deployments.rollouts.quality import quality_looks
from inferops.api import ERRORS, TOO_LARGE, ErrorSerializer, RejectUnknownFields
from inferops.validators import slug_validator

MAX_MEASUREMENTS = 50
ROLLOUT_ERRORS = {**ERRORS, 404: OpenApiResponse(ErrorSerializer, description="Unknown deployment or rollout.")}
ROLLOUT_CONFLICT = {409: OpenApiResponse(ErrorSerializer, description=(
    "Refused in the current state, with the reason: another rollout of the deployment is active, an SLO's "
    "error budget is exhausted (the SLO is named), a degradation level freezes rollouts (the level is named), "
    "the rollout has already finished, or the deployment is paused or being deleted."))}


@extend_schema_field({"type": "array", "items": {"type": "object"},
                      "example": [{"set_weight": 20}, {"pause": "60s"}, {"analysis": "2m"}]})
class StepsField(serializers.JSONField):
    """Canary steps; their content is checked by deployments.rollouts.spec, one message per bad step."""


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "number"}], "example": "10m"})
class DurationField(serializers.JSONField):
    """A duration: "90s", "2m", "1h30m" or a number of seconds (checked by rollout_spec)."""


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "object"}], "example": "2m"})
class DurationOrObjectField(serializers.JSONField):
    """A duration, or an object (preview `{}`: until promoted; analysis: duration, min_requests, ...)."""


@extend_schema_field({"type": "object", "example": {"eval_set": "tiny-facts", "max_drop": 0.05, "min_score": 0.8},
                      "properties": {"eval_set": {"type": "string"}, "max_drop": {"type": "number"},
                                     "min_score": {"type": "number"}, "set_version": {"type": "integer"},
                                     "timeout": {"oneOf": [{"type": "string"}, {"type": "number"}]}}})
class QualityStepField(serializers.JSONField):
    """A quality step: eval_set, max_drop and/or min_score (0-1), optional set_version and timeout (15m)."""


class QualityLookSerializer(serializers.Serializer):
    attempt = serializers.IntegerField()
    step_index = serializers.IntegerField()
    eval_set = serializers.CharField()
    set_version = serializers.IntegerField(allow_null=True)
    runs = serializers.DictField(child=serializers.IntegerField(), help_text="Eval run ids: candidate, stable.")
    verdict = serializers.ChoiceField(Verdict.choices, allow_null=True)
    reason = serializers.CharField(allow_blank=True)
    link = serializers.CharField(allow_blank=True, help_text="The candidate run's failing cases.")
    candidate = serializers.DictField(help_text="run, status, done, total, score, url.")
    stable = serializers.DictField(help_text="run, score, basis (latest run, run on stable or parity), url.")


class StrictSerializer(RejectUnknownFields, serializers.Serializer):
    """Unknown keys are refused with a 400 naming each of them."""


class RolloutCreateSerializer(StrictSerializer):
    version = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                       help_text="Candidate version number (or give `alias`).")
    alias = serializers.CharField(max_length=63, required=False, allow_blank=True,
                                  help_text="Candidate version by alias, resolved now.")
    engine_args = serializers.DictField(required=False, help_text=(
        "Candidate engine arguments (replace the deployment's); omitted: the deployment's own."))
    strategy = serializers.ChoiceField(Strategy.choices, default=Strategy.CANARY)
    steps = StepsField(required=False, allow_null=True, help_text=(
        "Canary: set_weight (percent), pause (duration, or {} until promoted), analysis (duration or "
        "{duration, min_requests, max_burn_rate, thresholds}) and quality ({eval_set, max_drop, min_score, "
        "set_version, timeout}: the candidate scored on an eval set through its preview route against the stable "
        "version). Omitted: 10% / analysis 2m / 50% / analysis 2m."))
    scale_down_delay = DurationField(required=False, allow_null=True,
                                     help_text="Blue-green: how long the old set stays warm after the switch.")
    preview = DurationOrObjectField(required=False, allow_null=True, help_text=(
        "Blue-green: keep the candidate on `<deployment>--preview` for this long ({} = until promoted)."))
    analysis = DurationOrObjectField(required=False, allow_null=True,
                                     help_text="Blue-green: analysis after the switch (duration or object).")
    quality = QualityStepField(required=False, allow_null=True, help_text=(
        "Blue-green: score the candidate on an eval set through the preview route before the switch (and "
        "before the preview pause); aborts when it drops more than max_drop under the stable version's score "
        "or scores under min_score."))
    rollback = serializers.BooleanField(default=False, help_text="A rollback: allowed while a budget is exhausted.")
    override_reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000, help_text=(
        "Go ahead although an SLO's error budget is exhausted; recorded in the audit log."))
    promote_alias = serializers.CharField(max_length=63, allow_blank=True, default="champion",
                                          validators=[slug_validator],
                                          help_text="Alias moved to the candidate on success; \"\" for none.")
    watch = DurationField(required=False, allow_null=True, help_text=(
        "After success, how long the platform watches the new version (default 10m; 0: no watch). If it burns "
        "an SLO the previous version did not, the platform rolls it back by itself. Rollbacks are not watched."))
    auto_rollback = serializers.BooleanField(default=True, help_text=(
        "Roll back by itself during the watch; can be turned off later (PATCH the rollout)."))
    holdback = serializers.IntegerField(min_value=0, max_value=50, required=False, allow_null=True, help_text=(
        "During the watch, percent of traffic kept on the previous version so the new one is judged against "
        "it at the same time (default INFEROPS_ROLLOUT_HOLDBACK_PERCENT, 5; 0: none, then the new version is "
        "compared with the previous one's past, at a comparable load, and a failure must persist)."))


class PromoteSerializer(StrictSerializer):
    full = serializers.BooleanField(default=False, help_text="Skip every remaining step.")
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000,
                                   help_text="Why; recorded in the rollout's timeline and the audit log.")


class AbortSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class RetrySerializer(StrictSerializer):
    override_reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class UndoSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000, help_text=(
        "Why: required when the undo redeploys a version the platform rolled back during its watch."))
    override_reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000, help_text=(
        "Such a redeploy is a rollout like any other: go ahead although an SLO's error budget is exhausted "
        "(audited)."))


class RolloutPatchSerializer(StrictSerializer):
    auto_rollback = serializers.BooleanField(help_text="Roll back by itself during the watch after success.")


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
        "progressing or paused while it runs; succeeded or aborted when done; rolled_back when the platform "
        "undid it during its watch (`rolled_back_by` is the rollback, `message` says why)."))
    watching = serializers.BooleanField(read_only=True, help_text=(
        "Succeeded and watched now (until `watch_until`, automatic rollback on): CI waits while this is true."))
    stable = serializers.SerializerMethodField()
    candidate = serializers.SerializerMethodField()
    steps = StepsField()
    current_step = serializers.SerializerMethodField()
    weight = serializers.IntegerField(help_text="Percent of traffic on the candidate now.")
    timeline = TimelineField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)
    quality = serializers.SerializerMethodField(help_text=(
        "Each quality step's eval runs and its latest look, by attempt and step; `link` lists the failing cases."))

    class Meta:
        model = Rollout
        fields = ["id", "deployment", "strategy", "status", "rollback", "stable", "candidate", "steps", "current_step",
                  "weight", "message", "timeline", "scale_down_delay_s", "scale_down_at", "promote_alias",
                  "override_reason", "created_by", "created_at", "updated_at", "finished_at", "frozen_since",
                  "watch_s", "auto_rollback", "holdback_percent", "watch_until", "watching", "rolled_back_by",
                  "quality"]
        read_only_fields = fields

    @extend_schema_field(QualityLookSerializer(many=True))
    def get_quality(self, rollout: Rollout) -> list:
        return quality_looks(rollout)

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


def rollout_response(rollout: Rollout, code: int = status.HTTP_200_OK) -> Response:
    return Response(RolloutDetailSerializer(rollout_queryset().get(pk=rollout.pk)).data, status=code)


def validated(serializer_class, request) -> dict:
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


@extend_schema(tags=["rollouts"])
class RolloutViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    # A deployment's rollouts: start, list, follow, change; promote, abort, retry and undo are actions.
    serializer_class = RolloutSerializer
    lookup_url_kwarg = "rollout_id"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no URL kwargs
            return Rollout.objects.none()
        deployment = get_object_or_404(Deployment, name=self.kwargs["name"])
        queryset = rollout_queryset().filter(deployment=deployment)
        if self.action == "list":
            queryset = queryset.order_by("-id")
            if state := self.request.query_params.get("status"):
                queryset = queryset.filter(status=state)
        return queryset

    def act(self, request, service, serializer_class) -> Response:
        """One rollout action: the rollout, the body checked by `serializer_class`, then one service call."""
        rollout = self.get_object()
        data = validated(serializer_class, request)
        return rollout_response(service(rollout=rollout, actor=request.user, **data))

    @extend_schema(parameters=[OpenApiParameter("status", OpenApiTypes.STR, enum=RolloutStatus.values)],
                   responses={200: RolloutSerializer(many=True), **ROLLOUT_ERRORS},
                   description="The deployment's rollouts, newest first.")
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=RolloutCreateSerializer,
                   responses={201: RolloutDetailSerializer, **ROLLOUT_ERRORS, **ROLLOUT_CONFLICT, **TOO_LARGE},
                   description="Start moving the deployment to a candidate (version, alias and/or engine_args). "
                               "Refused (409) while another rollout is active or an SLO's error budget is "
                               "exhausted, unless `rollback` is true or `override_reason` is given (audited), and "
                               "while a degradation level freezes rollouts, unless `rollback` is true.")
    def create(self, request, name: str):
        deployment = get_object_or_404(Deployment, name=name)
        data = validated(RolloutCreateSerializer, request)
        rollout = rollouts.rollout_create(deployment=deployment, actor=request.user, **data)
        return rollout_response(rollout, status.HTTP_201_CREATED)

    @extend_schema(responses={200: RolloutDetailSerializer, **ROLLOUT_ERRORS},
                   description="The rollout with its current step and weight, for CI to poll, and its measurements.")
    def retrieve(self, request, name: str, rollout_id: int):
        return Response(RolloutDetailSerializer(self.get_object()).data)

    @extend_schema(request=RolloutPatchSerializer, responses=ACTION_RESPONSES,
                   description="Turn the automatic rollback on or off while the rollout runs or is watched after "
                               "success (audited); 409 once the watch is over, or for a rollback.")
    def partial_update(self, request, name: str, rollout_id: int):
        return self.act(request, rollouts.rollout_set_auto_rollback, RolloutPatchSerializer)

    @extend_schema(request=PromoteSerializer, responses=ACTION_RESPONSES,
                   description="Go on to the next step now (ends a pause or an inconclusive analysis), or "
                               "with `full` skip every remaining step.")
    @action(detail=True, methods=["post"])
    def promote(self, request, name: str, rollout_id: int):
        return self.act(request, rollouts.rollout_promote, PromoteSerializer)

    @extend_schema(request=AbortSerializer, responses=ACTION_RESPONSES,
                   description="Traffic back on the stable version at once; the candidate's replicas are drained.")
    @action(detail=True, methods=["post"])
    def abort(self, request, name: str, rollout_id: int):
        return self.act(request, rollouts.rollout_abort, AbortSerializer)

    @extend_schema(request=RetrySerializer, responses=ACTION_RESPONSES,
                   description="Start an aborted rollout again from its first step.")
    @action(detail=True, methods=["post"])
    def retry(self, request, name: str, rollout_id: int):
        return self.act(request, rollouts.rollout_retry, RetrySerializer)

    @extend_schema(
        request=UndoSerializer,
        responses={200: OpenApiResponse(RolloutDetailSerializer, description="The active rollout, now aborted."),
                   201: OpenApiResponse(RolloutDetailSerializer, description="A blue-green rollback rollout to "
                                        "the version and engine args before the last successful rollout, or the "
                                        "redeploy of a version the platform rolled back."),
                   **ROLLOUT_ERRORS, **ROLLOUT_CONFLICT},
        description="Back to the previous version: aborts the active rollout if there is one, else rolls back "
                    "the last successful rollout (allowed while an error budget is exhausted). When that was the "
                    "platform's own rollback during a watch, undo redeploys the version it rejected: a rollout "
                    "like the rejected one, under the budget policy, which needs a `reason`.")
    @action(detail=False, methods=["post"])
    def undo(self, request, name: str):
        deployment = get_object_or_404(Deployment, name=name)
        data = validated(UndoSerializer, request)
        rollout = rollouts.rollout_undo(deployment=deployment, actor=request.user, **data)
        created = rollout.status != RolloutStatus.ABORTED
        return rollout_response(rollout, status.HTTP_201_CREATED if created else status.HTTP_200_OK)
