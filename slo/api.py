"""REST API for SLOs: CRUD, the evaluated status, and per-minute or per-hour history for charts."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.core.exceptions import ValidationError as DjangoValidationError
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response

from alerts.api import AlertSerializer
from alerts.choices import OPEN_STATUSES
from deployments.models import Deployment
from evals.models import EvalSet
from inferops.api import CONFLICT, ERRORS, UrlOrBlankField, query_time
from inferops.timeparse import DURATION_HINT, format_duration, parse_duration
from inferops.validators import slug_validator
from registry.models import RegisteredModel
from slo import quality, services
from slo.budget import BURN_WINDOWS, MINUTE, alert_rules, floor_minute
from slo.choices import Budgeting, Scope, SliKind, SloState, Window
from slo.evaluation import evaluate_at
from slo.models import Slo

# Model field -> where it sits in the API body, so a clean() error names the field the client sent.
API_FIELD = {"sli_kind": "sli.kind", "ttft_ms": "sli.ttft_ms", "tpot_ms": "sli.tpot_ms", "e2e_ms": "sli.e2e_ms",
             "ratio_good": "sli.good", "ratio_total": "sli.total", "eval_set": "sli.eval_set",
             "eval_every_s": "sli.every"}
MAX_HISTORY_POINTS = 2000


@extend_schema_field(OpenApiTypes.STR)
class EverySecondsField(serializers.Field):
    """A schedule: "15m", "6h", "1d" or a number of seconds in; whole seconds stored, "6h" out."""

    def to_internal_value(self, data) -> int:
        try:
            seconds = parse_duration(data, "every")
        except ValueError:
            raise serializers.ValidationError(f"Expected {DURATION_HINT}.") from None
        if seconds <= 0 or seconds != int(seconds):
            raise serializers.ValidationError("A positive whole number of seconds.")
        return int(seconds)

    def to_representation(self, value: int) -> str:
        return format_duration(value)


class SliSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(SliKind.choices)
    ttft_ms = serializers.FloatField(required=False, allow_null=True, min_value=0)
    tpot_ms = serializers.FloatField(required=False, allow_null=True, min_value=0)
    e2e_ms = serializers.FloatField(required=False, allow_null=True, min_value=0)
    good = serializers.CharField(required=False, allow_blank=True, max_length=32,
                                 help_text="Ratio SLIs: the scraped series counting good events.")
    total = serializers.CharField(required=False, allow_blank=True, max_length=32,
                                  help_text="Ratio SLIs: the scraped series counting all events.")
    eval_set = serializers.SlugRelatedField(
        slug_field="name", queryset=EvalSet.objects.all(), required=False, allow_null=True,
        help_text="Quality SLIs: the eval set scored on the deployment; each case is an event, good when it "
                  "passes, and the objective is the floor (the fraction of cases that must pass).")
    every = EverySecondsField(required=False, allow_null=True,
                              help_text='Quality SLIs: how often the eval set is scored ("15m", "6h" or seconds; '
                                        "at least 5m).")


class StatusSerializer(serializers.Serializer):
    sli = serializers.FloatField(allow_null=True)
    good = serializers.IntegerField()
    total = serializers.IntegerField()
    budget_total = serializers.FloatField()
    budget_consumed = serializers.FloatField()
    budget_remaining = serializers.FloatField()
    burn_rates = serializers.DictField(child=serializers.FloatField())
    time_to_exhaustion_s = serializers.FloatField(allow_null=True)
    status = serializers.ChoiceField(SloState.choices, source="state",
                                     help_text="'insufficient' while the window has fewer than min_events events.")
    min_events = serializers.IntegerField(source="slo.min_requests",
                                          help_text="Events the window needs before the SLO is judged.")
    window_start = serializers.DateTimeField(allow_null=True)
    evaluated_at = serializers.DateTimeField(allow_null=True)


class QualityRunSerializer(serializers.Serializer):
    run = serializers.IntegerField(help_text="The eval run's id.")
    finished_at = serializers.DateTimeField()
    score = serializers.FloatField(help_text="Fraction of its cases passed.")
    passed = serializers.IntegerField()
    cases = serializers.IntegerField()
    set_version = serializers.IntegerField()
    url = serializers.CharField(help_text="Its console page, with the failing cases.")


class QualitySerializer(serializers.Serializer):
    floor = serializers.FloatField(help_text="The objective: the fraction of cases that must pass.")
    latest_run = QualityRunSerializer(allow_null=True, help_text="The latest run counted; below the floor, it pages.")


class SloSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    model = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    sli = serializers.SerializerMethodField()
    status = serializers.SerializerMethodField()
    quality = serializers.SerializerMethodField()
    runbook_url = UrlOrBlankField()

    class Meta:
        model = Slo
        fields = ["id", "name", "description", "owner", "runbook_url", "scope", "deployment", "model", "tenant", "sli",
                  "objective", "window", "time_zone", "budgeting", "timeslice_target", "min_requests",
                  "backfilled_from", "status", "quality", "created_at", "updated_at"]
        read_only_fields = fields

    @extend_schema_field(SliSerializer)
    def get_sli(self, slo: Slo) -> dict:
        sli = {"kind": slo.sli_kind, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
        if slo.sli_kind == SliKind.RATIO:
            sli.update(good=slo.ratio_good, total=slo.ratio_total)
        if slo.sli_kind == SliKind.QUALITY:
            sli.update(eval_set=slo.eval_set.name, every=format_duration(slo.eval_every_s),
                       every_s=slo.eval_every_s)
        return sli

    @extend_schema_field(StatusSerializer(allow_null=True))
    def get_status(self, slo: Slo) -> dict | None:
        evaluated = getattr(slo, "status", None)
        return StatusSerializer(evaluated).data if evaluated else None

    @extend_schema_field(QualitySerializer(allow_null=True))
    def get_quality(self, slo: Slo) -> dict | None:
        if slo.sli_kind != SliKind.QUALITY:
            return None
        runs = quality.run_history(slo, limit=1)
        return {"floor": slo.objective, "latest_run": QualityRunSerializer(runs[0]).data if runs else None}


class SloWriteSerializer(serializers.Serializer):
    """The issue's body. Scope defaults from what is given: a tenant makes it tenant-scoped, a
    model without a deployment model-scoped, else deployment-scoped."""

    name = serializers.CharField(max_length=63, validators=[slug_validator])
    description = serializers.CharField(required=False, allow_blank=True)
    owner = serializers.CharField(required=False, allow_blank=True, max_length=100)
    runbook_url = serializers.URLField(required=False, allow_blank=True, max_length=500)
    scope = serializers.ChoiceField(Scope.choices, required=False)
    deployment = serializers.SlugRelatedField(slug_field="name", queryset=Deployment.objects.filter(deleted_at=None),
                                              required=False, allow_null=True)
    model = serializers.SlugRelatedField(slug_field="name", queryset=RegisteredModel.objects.all(), required=False,
                                         allow_null=True)
    tenant = serializers.CharField(required=False, allow_blank=True, max_length=63)
    sli = SliSerializer()
    objective = serializers.FloatField()
    window = serializers.ChoiceField(Window.choices)
    time_zone = serializers.CharField(required=False, max_length=64)
    budgeting = serializers.ChoiceField(Budgeting.choices, default=Budgeting.OCCURRENCES)
    timeslice_target = serializers.FloatField(required=False, allow_null=True)
    min_requests = serializers.IntegerField(required=False, min_value=0, max_value=10**9)

    def to_fields(self) -> dict:
        """validated_data as Slo fields."""
        data = dict(self.validated_data)
        if "sli" in data:
            sli = data.pop("sli")
            data["sli_kind"] = sli["kind"]
            for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
                data[name] = sli.get(name)
            data["ratio_good"], data["ratio_total"] = sli.get("good") or "", sli.get("total") or ""
            data["eval_set"], data["eval_every_s"] = sli.get("eval_set"), sli.get("every")
        if "scope" not in data and not self.partial:
            if data.get("tenant"):
                data["scope"] = Scope.TENANT
            elif data.get("model") and not data.get("deployment"):
                data["scope"] = Scope.MODEL
            else:
                data["scope"] = Scope.DEPLOYMENT
        return data


def api_validation_error(exc: DjangoValidationError) -> ValidationError:
    messages = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
    return ValidationError({API_FIELD.get(field, field): errors for field, errors in messages.items()})


def slo_queryset():
    return Slo.objects.select_related("deployment", "model", "eval_set", "status")


def get_slo(pk: int) -> Slo:
    return get_object_or_404(slo_queryset(), pk=pk)


def alert_thresholds(slo: Slo) -> list[dict]:
    return [{"severity": rule.severity, "factor": rule.factor, "long_window_minutes": rule.long_minutes,
             "short_window_minutes": rule.short_minutes, "long_window": format_duration(rule.long_minutes * 60),
             "short_window": format_duration(rule.short_minutes * 60)} for rule in alert_rules(slo.window)]


def data_start(slo: Slo) -> datetime:
    """Where the SLO's SLI data begin: the back-fill's first minute, else its creation."""
    return floor_minute(slo.backfilled_from or slo.created_at)


def history_points(start: datetime, end: datetime, step: str) -> list[datetime]:
    delta = MINUTE if step == "minute" else timedelta(hours=1)
    first = floor_minute(start) if step == "minute" else start.replace(minute=0, second=0, microsecond=0)
    count = int((end - first) / delta) + 1
    if count > MAX_HISTORY_POINTS:
        raise ValidationError({"end": [f"{count} points of one {step}; at most {MAX_HISTORY_POINTS}: "
                                       "narrow the range or use step=hour."]})
    return [first + i * delta for i in range(max(count, 0))]


def chart_points(slo: Slo, start: datetime, end: datetime, step: str) -> list[datetime]:
    """The moments to evaluate: none before the SLO's data begin (a budget there would be a made-up
    100 %), none after its last evaluation (minutes not folded in yet would read as no traffic),
    and that evaluation's own moment last, so the last point is the figure the status shows."""
    evaluated_at = getattr(getattr(slo, "status", None), "evaluated_at", None)
    if evaluated_at is None:
        return []
    begin = data_start(slo)
    points = [max(moment, begin) for moment in history_points(start, end, step)
              if begin <= moment + (MINUTE if step == "minute" else timedelta(hours=1)) and moment <= evaluated_at]
    points = sorted(set(points))
    if start <= evaluated_at <= end and evaluated_at >= begin and (not points or evaluated_at > points[-1]):
        if points and floor_minute(evaluated_at) == points[-1]:
            points.pop()
        points.append(evaluated_at)
    return points


@extend_schema(tags=["slos"])
class SloViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    # SLOs (CRUD) and, per SLO, its evaluated status and its history for charts.
    serializer_class = SloSerializer

    def get_queryset(self):
        if self.action != "list":
            return slo_queryset()
        queryset = slo_queryset().order_by("status__budget_remaining", "name")
        params = self.request.query_params
        if deployment := params.get("deployment"):
            queryset = queryset.filter(deployment__name=deployment)
        if state := params.get("status"):
            queryset = queryset.filter(status__state=state)
        return queryset

    @extend_schema(parameters=[OpenApiParameter("deployment", OpenApiTypes.STR),
                               OpenApiParameter("status", OpenApiTypes.STR, enum=SloState.values)],
                   responses={200: SloSerializer(many=True), **ERRORS},
                   description="SLOs sorted by remaining error budget, the most burnt first.")
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=SloWriteSerializer, responses={201: SloSerializer, **ERRORS, **CONFLICT})
    def create(self, request):
        serializer = SloWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            slo = services.slo_create(actor=request.user, **serializer.to_fields())
        except DjangoValidationError as exc:
            raise api_validation_error(exc) from None
        return Response(SloSerializer(get_slo(slo.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: SloSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=SloWriteSerializer, responses={200: SloSerializer, **ERRORS, **CONFLICT},
                   description="Partial update. Changing what the SLI counts (kind, thresholds, scope, "
                               "budgeting) drops the stored minutes and back-fills them again.")
    def partial_update(self, request, pk: int):
        slo = self.get_object()
        serializer = SloWriteSerializer(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        try:
            services.slo_update(slo=slo, actor=request.user, **serializer.to_fields())
        except DjangoValidationError as exc:
            raise api_validation_error(exc) from None
        return Response(SloSerializer(get_slo(pk)).data)

    @extend_schema(responses={204: None, **ERRORS})
    def destroy(self, request, *args, **kwargs):
        services.slo_delete(slo=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={200: inline_serializer("SloStatus", {
        "slo": serializers.CharField(), "sli": serializers.FloatField(allow_null=True),
        "budget_remaining": serializers.FloatField(), "burn_rates": serializers.DictField(),
        "status": serializers.ChoiceField(SloState.choices), "alerts": AlertSerializer(many=True),
        "good": serializers.IntegerField(), "total": serializers.IntegerField(),
        "budget_total": serializers.FloatField(), "budget_consumed": serializers.FloatField(),
        "min_events": serializers.IntegerField(),
        "time_to_exhaustion_s": serializers.FloatField(allow_null=True),
        "window_start": serializers.DateTimeField(allow_null=True),
        "evaluated_at": serializers.DateTimeField(allow_null=True),
        "backfilled_from": serializers.DateTimeField(allow_null=True),
        "alert_thresholds": serializers.ListField(child=serializers.DictField()),
    }), **ERRORS})
    @action(detail=True, methods=["get"], url_path="status")
    def evaluated_status(self, request, pk: int):
        slo = self.get_object()
        body = {"slo": slo.name, **StatusSerializer(slo.status).data}
        firing = slo.alerts.filter(status__in=OPEN_STATUSES).select_related("slo")
        body.update(alerts=AlertSerializer(firing, many=True).data, backfilled_from=slo.backfilled_from,
                    alert_thresholds=alert_thresholds(slo))
        return Response(body)

    @extend_schema(responses={200: inline_serializer("SloEvalRuns", {
        "slo": serializers.CharField(), "floor": serializers.FloatField(), "eval_set": serializers.CharField(),
        "every_s": serializers.IntegerField(), "runs": QualityRunSerializer(many=True)}), **ERRORS},
        description="A quality SLO's eval runs counted into its minutes, oldest first (the last 500): each run's "
                    "score against the floor.")
    @action(detail=True, methods=["get"], url_path="eval-runs")
    def eval_runs(self, request, pk: int):
        slo = self.get_object()
        if slo.sli_kind != SliKind.QUALITY:
            raise NotFound(f"SLO {slo.name} is a {slo.sli_kind} SLO: only quality SLOs have eval runs.")
        return Response({"slo": slo.name, "floor": slo.objective, "eval_set": slo.eval_set.name,
                         "every_s": slo.eval_every_s,
                         "runs": QualityRunSerializer(quality.run_history(slo), many=True).data})

    @extend_schema(
        parameters=[
            OpenApiParameter("start", OpenApiTypes.DATETIME, description="Default: 24 hours before end."),
            OpenApiParameter("end", OpenApiTypes.DATETIME, description="Default: now."),
            OpenApiParameter("step", OpenApiTypes.STR, enum=["minute", "hour"],
                             description="Default: minute up to a day, hour beyond."),
        ],
        responses={200: OpenApiTypes.OBJECT, **ERRORS},
        description="SLI, budget remaining (negative when overspent) and burn rates as they stood at each minute "
                    "or hour (from the stored minute rows), with the alert thresholds and the alerts of the range. "
                    "Points start no earlier than `data_start` (the SLO's first minute of data) and end at the "
                    "last evaluation (`evaluated_at`), whose figures are those of the status.",
    )
    @action(detail=True, methods=["get"])
    def history(self, request, pk: int):
        slo = self.get_object()
        params = request.query_params
        end = query_time(params.get("end"), "end", timezone.now())
        start = query_time(params.get("start"), "start", end - timedelta(days=1))
        if start >= end:
            raise ValidationError({"start": ["start must be before end."]})
        step = params.get("step") or ("minute" if end - start <= timedelta(days=1) else "hour")
        if step not in ("minute", "hour"):
            raise ValidationError({"step": [f"{step!r}: use minute or hour."]})
        points = chart_points(slo, start, end, step)
        evaluations = evaluate_at([(slo, moment) for moment in points])
        alerts = slo.alerts.filter(starts_at__lte=end).exclude(ends_at__lt=start).select_related("slo")
        evaluated = getattr(slo, "status", None)
        return Response({
            "slo": slo.name, "step": step, "objective": slo.objective, "burn_windows": list(BURN_WINDOWS),
            "alert_thresholds": alert_thresholds(slo), "min_events": slo.min_requests,
            "data_start": data_start(slo), "evaluated_at": evaluated.evaluated_at if evaluated else None,
            "points": [
                {"time": ev.at, "sli": ev.budget.sli, "budget_remaining": ev.budget.budget_remaining,
                 "good": ev.counts.good, "total": ev.counts.total, "burn_rates": ev.burn_rates,
                 "insufficient_traffic": ev.insufficient_traffic}
                for ev in evaluations
            ],
            "alerts": AlertSerializer(alerts, many=True).data,
        })
