"""REST API for finance tools and operators: the price book, list prices, budgets, the report."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, renderers, serializers, status, viewsets
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from costing import compare, services
from costing.choices import Tier
from costing.ledger import floor_hour, ledger_sync, ledger_through
from costing.models import Budget, ListPrice, Price
from costing.report import month_range, prices_in_effect, report_csv, report_for
from inferops.api import CONFLICT, ERRORS, TOO_LARGE, AuthenticateBeforeFormat, RejectUnknownFields, query_time
from inferops.validators import slug_validator
from registry.models import ModelVersion, RegisteredModel
from tenants.models import Tenant

MONTH_RE = re.compile(r"^(\d{4})-(\d{2})$")
MAX_REPORT_SPAN = timedelta(days=400)


class MoneyField(serializers.DecimalField):
    """A decimal string ("0.05") or an integer; a JSON float is refused, so no amount is ever a
    binary fraction on its way in."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_digits", 18)
        kwargs.setdefault("decimal_places", 6)
        kwargs.setdefault("min_value", Decimal(0))
        super().__init__(**kwargs)
        self.error_messages["min_value"] = "Must not be negative."

    def to_internal_value(self, data):
        if isinstance(data, float):
            raise serializers.ValidationError(f'Send money as a decimal string, e.g. "{data}", not a JSON number.')
        if isinstance(data, bool):
            raise serializers.ValidationError("A valid number is required.")
        return super().to_internal_value(data)


class PriceSerializer(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)

    class Meta:
        model = Price
        fields = ["id", "resource", "tier", "usd_per_hour", "effective_from", "effective_to", "note", "created_by",
                  "created_at"]
        read_only_fields = fields


class PriceCreatedSerializer(PriceSerializer):
    warnings = serializers.ListField(
        child=serializers.CharField(), read_only=True,
        help_text="What looks wrong without being refused: a start back-dated into an ended month, a resource "
                  "no replica holds.")

    class Meta(PriceSerializer.Meta):
        fields = [*PriceSerializer.Meta.fields, "warnings"]
        read_only_fields = fields


class PriceCreateSerializer(RejectUnknownFields, serializers.Serializer):
    resource = serializers.CharField(max_length=100, help_text="cpu, memory, gpu:<gpu_type> or node:<node name>")
    usd_per_hour = MoneyField(help_text="Per core-hour (cpu), GiB-hour (memory), GPU-hour or node-hour.")
    effective_from = serializers.DateTimeField()
    effective_to = serializers.DateTimeField(required=False, allow_null=True, default=None)
    tier = serializers.ChoiceField(choices=Tier.choices, default=Tier.ON_DEMAND)
    note = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    def validate_resource(self, value):
        services.validate_resource(value)
        return value


class ListPriceSerializer(serializers.ModelSerializer):
    class Meta:
        model = ListPrice
        fields = ["id", "deployment", "tenant", "usd_per_mtok_prompt", "usd_per_mtok_completion",
                  "batch_discount_percent", "effective_from", "created_at"]
        read_only_fields = ["id", "created_at"]


class ListPriceCreateSerializer(RejectUnknownFields, serializers.Serializer):
    deployment = serializers.CharField(max_length=63, validators=[slug_validator])
    tenant = serializers.CharField(max_length=63, validators=[slug_validator], required=False, allow_blank=True,
                                   default="", help_text="Empty: the deployment's list price for every tenant.")
    usd_per_mtok_prompt = MoneyField()
    usd_per_mtok_completion = MoneyField()
    batch_discount_percent = MoneyField(
        max_digits=5, decimal_places=2, max_value=Decimal(100), required=False,
        default=services.DEFAULT_BATCH_DISCOUNT,
        help_text="Lines of offline batches pay the list price less this percentage (0-100, default 50).")
    effective_from = serializers.DateTimeField()


class BudgetSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name", read_only=True)

    class Meta:
        model = Budget
        fields = ["id", "tenant", "deployment", "monthly_usd", "thresholds", "created_at", "updated_at"]
        read_only_fields = fields


class BudgetCreateSerializer(RejectUnknownFields, serializers.Serializer):
    tenant = serializers.CharField(max_length=63, validators=[slug_validator])
    deployment = serializers.CharField(max_length=63, validators=[slug_validator], required=False, allow_blank=True,
                                       default="", help_text="Empty: all the tenant's deployments.")
    monthly_usd = MoneyField(max_digits=14, decimal_places=2)
    thresholds = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=1000), min_length=1,
                                       max_length=10, default=[50, 80, 100],
                                       help_text="Percentages of the budget that open a ticket, e.g. [50, 80, 100].")

    def validate_tenant(self, value):
        if not Tenant.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"No tenant named {value!r}.")
        return value


class BudgetUpdateSerializer(RejectUnknownFields, serializers.Serializer):
    monthly_usd = MoneyField(max_digits=14, decimal_places=2, required=False)
    thresholds = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=1000), min_length=1,
                                       max_length=10, required=False)


@extend_schema(tags=["costing"])
class PriceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = PriceSerializer

    def get_queryset(self):
        prices = Price.objects.select_related("created_by")
        if self.action == "list":
            for param in ("resource", "tier"):
                if value := self.request.query_params.get(param):
                    prices = prices.filter(**{param: value})
        return prices

    @extend_schema(parameters=[OpenApiParameter("resource", OpenApiTypes.STR),
                               OpenApiParameter("tier", OpenApiTypes.STR)],
                   responses={200: PriceSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=PriceCreateSerializer, responses={201: PriceCreatedSerializer, **ERRORS, **TOO_LARGE},
                   description="Add a price. An open-ended price of the same resource and tier that started "
                               "earlier ends where this one starts; other overlaps, and starts inside a closed "
                               "month, are refused (400 on effective_from). A start back-dated into an ended "
                               "month, or a resource no replica holds, is added with `warnings`.")
    def create(self, request):
        serializer = PriceCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        price = services.price_create(actor=request.user, **serializer.validated_data)
        price.warnings = services.price_warnings(price)
        return Response(PriceCreatedSerializer(price).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: PriceSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(responses={204: None, **ERRORS, **CONFLICT},
                   description="Only a price that has not started yet; change a charged one by adding a new price.")
    def destroy(self, request, *args, **kwargs):
        services.price_delete(price=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema(tags=["costing"])
class ListPriceViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    serializer_class = ListPriceSerializer
    queryset = ListPrice.objects.all()

    @extend_schema(responses={200: ListPriceSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=ListPriceCreateSerializer,
                   responses={201: ListPriceSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request):
        serializer = ListPriceCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        price = services.list_price_create(actor=request.user, **serializer.validated_data)
        return Response(ListPriceSerializer(price).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["costing"])
class BudgetViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = BudgetSerializer
    queryset = Budget.objects.select_related("tenant")

    @extend_schema(responses={200: BudgetSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=BudgetCreateSerializer,
                   responses={201: BudgetSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request):
        serializer = BudgetCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        budget = services.budget_create(
            tenant=Tenant.objects.get(name=data["tenant"]), deployment=data["deployment"],
            monthly_usd=data["monthly_usd"], thresholds=data["thresholds"], actor=request.user)
        return Response(BudgetSerializer(budget).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: BudgetSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=BudgetUpdateSerializer, responses={200: BudgetSerializer, **ERRORS},
                   description="Raising a budget above its spend resolves its alerts at once.")
    def partial_update(self, request, *args, **kwargs):
        budget = self.get_object()
        serializer = BudgetUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        budget = services.budget_update(budget=budget, actor=request.user, **serializer.validated_data)
        return Response(BudgetSerializer(budget).data)

    @extend_schema(responses={204: None, **ERRORS})
    def destroy(self, request, *args, **kwargs):
        services.budget_delete(budget=self.get_object(), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


# ---------------------------------------------------------------------------- the report


def parse_month(value: str, now: datetime) -> tuple[datetime, datetime]:
    match = MONTH_RE.match(value or "")
    if not match or not 1 <= int(match.group(2)) <= 12 or int(match.group(1)) < 2000:
        raise serializers.ValidationError({"month": [f"{value!r} is not a month: use YYYY-MM, e.g. 2026-03."]})
    start, end = month_range(datetime(int(match.group(1)), int(match.group(2)), 1, tzinfo=UTC).date())
    if start > now:
        raise serializers.ValidationError({"month": [f"{value} is in the future."]})
    return start, end


def report_period(params, now: datetime) -> tuple[datetime, datetime]:
    """?month=YYYY-MM, or ?start=&end= (whole hours; start floored, end rounded up), or this month."""
    if params.get("month") and (params.get("start") or params.get("end")):
        raise serializers.ValidationError({"month": ["Give month, or start and end, not both."]})
    if params.get("month") or not (params.get("start") or params.get("end")):
        return parse_month(params.get("month") or now.strftime("%Y-%m"), now)
    if not params.get("start"):
        raise serializers.ValidationError({"start": ["start is required with end."]})
    start = floor_hour(query_time(params.get("start"), "start", now))
    raw_end = query_time(params.get("end"), "end", now)
    end = floor_hour(raw_end) + (timedelta(hours=1) if raw_end != floor_hour(raw_end) else timedelta(0))
    if start > now:
        raise serializers.ValidationError({"start": ["start is in the future."]})
    if end <= start:
        raise serializers.ValidationError({"end": ["end must come after start."]})
    if end - start > MAX_REPORT_SPAN:
        raise serializers.ValidationError({"end": [f"A report covers at most {MAX_REPORT_SPAN.days} days."]})
    return start, end


def current_report(params) -> tuple[dict, datetime, datetime]:
    now = timezone.now()
    start, end = report_period(params, now)
    through = ledger_through()
    if end > now and (through is None or through < now - timedelta(minutes=1)):
        ledger_sync(now)  # an open period includes cost up to the last full minute
    return report_for(start, min(end, now), now=now), start, end


class CSVRenderer(renderers.BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data


class PDFRenderer(renderers.BaseRenderer):
    media_type = "application/pdf"
    format = "pdf"
    charset = None
    render_style = "binary"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data


def export_response(report: dict, kind: str) -> HttpResponse:
    name = f"inferops-costs-{report['start'][:10]}-{report['end'][:10]}"
    if kind == "csv":
        response = HttpResponse(report_csv(report), content_type="text/csv; charset=utf-8")
    else:
        from costing.pdf import report_pdf

        period = datetime.fromisoformat(report["start"]), datetime.fromisoformat(report["end"])
        pdf = report_pdf(report, prices=prices_in_effect(*period), generated_at=timezone.now())
        response = HttpResponse(pdf, content_type="application/pdf")
    response["Content-Disposition"] = f'attachment; filename="{name}.{kind}"'
    return response


class ReportSerializer(serializers.Serializer):
    """The report's headline fields (the response has more: by_model, by_version, daily, rows)."""

    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    currency = serializers.CharField()
    closed = serializers.BooleanField()
    total_usd = serializers.CharField(help_text="Decimal string.")
    idle_usd = serializers.CharField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    usd_per_mtok = serializers.CharField(allow_null=True)
    usd_per_mtok_slo_compliant = serializers.CharField(allow_null=True)
    # Not required: a month closed before GPU telemetry answers its frozen report, which has none.
    gpu_hours = serializers.CharField(
        required=False, help_text="GPU-hours the ledger priced (minutes x GPUs held), decimal string.")
    gpu_hours_busy = serializers.CharField(
        required=False, help_text="Busy GPU-hours by the GPU telemetry: utilisation x the GPU-hours it measured.")
    gpu_busy_share = serializers.CharField(required=False, allow_null=True, help_text=(
        "Busy GPU-hours / GPU-hours measured by the GPU telemetry (0..1, decimal string); null: not measured."))
    gpu_hours_not_measured = serializers.CharField(
        required=False, help_text="GPU-hours no GPU telemetry covered: not measured, not idle.")
    by_tenant = serializers.ListField(child=serializers.DictField())
    by_deployment = serializers.ListField(child=serializers.DictField())


@extend_schema(tags=["costing"])
class Report(AuthenticateBeforeFormat, APIView):
    renderer_classes = [renderers.JSONRenderer, renderers.BrowsableAPIRenderer, CSVRenderer, PDFRenderer]

    @extend_schema(parameters=[
        OpenApiParameter("month", OpenApiTypes.STR, description="YYYY-MM (default: this month)"),
        OpenApiParameter("start", OpenApiTypes.STR, description="ISO 8601 or Unix seconds; floored to the hour"),
        OpenApiParameter("end", OpenApiTypes.STR, description="ISO 8601 or Unix seconds; rounded up to the hour"),
        OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv", "pdf"]),
    ], responses={200: ReportSerializer, **ERRORS,
                  (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR,
                                                     description="One row per tenant x deployment x version."),
                  (200, "application/pdf"): OpenApiResponse(OpenApiTypes.BINARY, description="The report on paper.")},
        description="Cost, idle cost, tokens and $/MTok (also per SLO-compliant token) by tenant, deployment, "
                    "model and version. A closed month answers its frozen report.")
    def get(self, request):
        report, _, _ = current_report(request.query_params)
        kind = request.query_params.get("format") or "json"
        if kind in ("csv", "pdf"):
            return export_response(report, kind)
        return Response(report)


# ---------------------------------------------------------------------------- version comparison


def _version_param(model: RegisteredModel, params, name: str) -> ModelVersion | None:
    value = params.get(name)
    if value in (None, ""):
        return None
    if not value.isdigit() or not int(value):
        raise serializers.ValidationError({name: [f"{value!r} is not a version number."]})
    version = model.versions.filter(number=int(value)).first()
    if version is None:
        known = ", ".join(str(n) for n in model.versions.order_by("number").values_list("number", flat=True))
        raise serializers.ValidationError({name: [
            f"{model.name} has no version {value} (versions: {known or 'none'})."]})
    return version


def _days_param(params) -> int:
    value = params.get("days")
    if value in (None, ""):
        return compare.DEFAULT_DAYS
    if not value.isdigit() or not 1 <= int(value) <= compare.MAX_DAYS:
        raise serializers.ValidationError({"days": [f"Give a whole number of days from 1 to {compare.MAX_DAYS}."]})
    return int(value)


def versions_compare_for(name: str, params) -> dict:
    """?a=&b=&days= read and checked (400 naming the parameter), then the comparison. Without a
    and b: the latest version (b) against its predecessor (a)."""
    model = RegisteredModel.objects.filter(name=name).first()
    if model is None:
        raise NotFound(f"No model named {name!r}.")
    a, b, days = _version_param(model, params, "a"), _version_param(model, params, "b"), _days_param(params)
    b = b or model.versions.order_by("-number").first()
    if a is None and b is not None:
        a = model.versions.filter(number__lt=b.number).order_by("-number").first()
    if a is None or b is None:
        missing = f"{model.name} has no version before {b.number}: give a and b." if b else \
            f"{model.name} has no versions yet."
        raise serializers.ValidationError({"a": [missing]})
    if a == b:
        raise serializers.ValidationError({"b": [f"a and b are both version {a.number}: give two different versions."]})
    return compare.versions_compare(model=model, a=a, b=b, days=days, now=timezone.now())


class CompareSideSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    description = serializers.CharField()
    serving = serializers.ListField(child=serializers.CharField(), help_text="Deployments serving it now.")
    speed = serializers.DictField(help_text="requests, ttft_p95_ms, tpot_p95_ms (null: no requests).")
    cost = serializers.DictField(help_text="usd, tokens, usd_per_mtok, usd_per_mtok_slo_compliant (null: no data).")


class CompareSerializer(serializers.Serializer):
    model = serializers.CharField()
    days = serializers.IntegerField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    ledger_through = serializers.DateTimeField(allow_null=True)
    deployments = serializers.ListField(child=serializers.CharField())
    a = CompareSideSerializer()
    b = CompareSideSerializer()
    scores = serializers.ListField(child=serializers.DictField(), help_text=(
        "Per eval set version: {eval_set, set_version, cases, a, b, better}; a and b are the latest succeeded "
        "run ({run, score, scores, finished_at}) or null."))
    speed = serializers.DictField(help_text="ttft_p95_ms and tpot_p95_ms: {a, b, better, better_is}.")
    cost = serializers.DictField(help_text="usd_per_mtok and usd_per_mtok_slo_compliant: {a, b, better, better_is}.")


@extend_schema(tags=["costing"])
class VersionCompare(APIView):
    @extend_schema(parameters=[
        OpenApiParameter("a", OpenApiTypes.INT, description="A version number (default: b's predecessor)"),
        OpenApiParameter("b", OpenApiTypes.INT, description="A version number (default: the latest)"),
        OpenApiParameter("days", OpenApiTypes.INT, description=f"Window of speed and cost, 1 to {compare.MAX_DAYS} "
                                                                f"(default {compare.DEFAULT_DAYS})"),
    ], responses={200: CompareSerializer, **ERRORS},
        description="Two versions of a model side by side: scores per eval set version (latest succeeded run), "
                    "TTFT and TPOT p95 and $/MTok (also per SLO-compliant token) over the window. null: no data.")
    def get(self, request, name: str):
        return Response(versions_compare_for(name, request.query_params))
