"""Console pages: the monthly cost report (charts, tables, drill-down, exports), the price book
and budgets."""

from __future__ import annotations

from decimal import Decimal
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError as ApiValidationError

from costing import services
from costing.api import current_report, export_response, versions_compare_for
from costing.choices import RESOURCE_UNITS, Tier
from costing.ledger import resources_held
from costing.models import Budget, Price
from costing.report import allocation_method, gpu_busy_text, report_in_cents
from inferops.console import tell_and_return
from inferops.forms import apply_service
from inferops.roles import require_operator
from registry.models import RegisteredModel
from tenants.models import Tenant


def _first_error(exc: ApiValidationError) -> str:
    detail = exc.detail
    if isinstance(detail, dict):
        field, errors = next(iter(detail.items()))
        return f"{field}: {errors[0] if isinstance(errors, list) else errors}"
    return str(detail)


def _period_query(params, start) -> str:
    """The exports' query: the page's period (a month, or start and end), without its drill-down."""
    period = {name: params[name] for name in ("start", "end") if params.get(name)}
    return urlencode(period or {"month": start.strftime("%Y-%m")})


@login_required
def report_page(request):
    try:
        report, start, _ = current_report(request.GET)
    except ApiValidationError as exc:
        return render(request, "costing/report.html",
                      {"error": _first_error(exc), "month": request.GET.get("month", "")}, status=400)
    tenant = request.GET.get("tenant", "")
    report = report_in_cents(report)
    for figures in (report, *report["by_deployment"]):
        figures["gpu_busy_text"] = gpu_busy_text(figures)
    drill = next((row for row in report["by_tenant"] if row["tenant"] == tenant), None) if tenant else None
    return render(request, "costing/report.html", {
        "report": report, "month": start.strftime("%Y-%m"), "tenant": tenant, "drill": drill,
        "allocation": allocation_method(report),
        "period_query": _period_query(request.GET, start),
        "max_month": timezone.now().strftime("%Y-%m"),
    })


@login_required
def export(request, kind: str):
    if kind not in ("csv", "pdf"):
        return render(request, "costing/report.html", {"error": f"Unknown export {kind!r}: csv or pdf."}, status=404)
    try:
        report, _, _ = current_report(request.GET)
    except ApiValidationError as exc:
        return render(request, "costing/report.html", {"error": _first_error(exc)}, status=400)
    return export_response(report, kind)


class PriceForm(forms.Form):
    resource = forms.CharField(max_length=100, help_text="cpu, memory, gpu:<gpu_type> or node:<node name>")
    usd_per_hour = forms.DecimalField(label="USD per hour", max_digits=18, decimal_places=6, min_value=0,
                                      help_text="per core, GiB, GPU or node")
    tier = forms.ChoiceField(choices=Tier.choices, initial=Tier.ON_DEMAND)
    effective_from = forms.DateTimeField(help_text="UTC, e.g. 2026-03-01 00:00",
                                         widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    note = forms.CharField(max_length=200, required=False)

    def clean_effective_from(self):
        value = self.cleaned_data["effective_from"]
        return value if timezone.is_aware(value) else timezone.make_aware(value, timezone.UTC)


@login_required
def price_book(request):
    form = PriceForm(request.POST or None, initial={"effective_from": timezone.now().strftime("%Y-%m-%dT%H:%M")})
    if request.method == "POST":
        require_operator(request, "Changing prices")
        if form.is_valid():
            created = apply_service(form, lambda: services.price_create(actor=request.user, **form.cleaned_data))
            if created:
                messages.success(request, f"Price added: {created}.")
                for warning in services.price_warnings(created):
                    messages.warning(request, f"{created.resource}: {warning}")
                return redirect("costing:prices")
    now = timezone.now()
    held = resources_held()
    prices = [(price, price.effective_from > now, services.price_warnings(price, held=held))
              for price in Price.objects.select_related("created_by")]
    return render(request, "costing/prices.html", {"form": form, "prices": prices, "units": RESOURCE_UNITS},
                  status=400 if request.method == "POST" else 200)


@login_required
@require_POST
def price_delete(request, pk: int):
    require_operator(request, "Changing prices")
    price = get_object_or_404(Price, pk=pk)
    # A price already charged is refused (a Conflict): said on the page, not a server error.
    return tell_and_return(request, lambda: services.price_delete(price=price, actor=request.user),
                           f"Price removed: {price}.", "costing:prices")


class BudgetForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.order_by("name"), to_field_name="name")
    deployment = forms.SlugField(max_length=63, required=False, help_text="empty = all its deployments")
    monthly_usd = forms.DecimalField(label="USD per month", max_digits=14, decimal_places=2, min_value=Decimal("0.01"))
    thresholds = forms.CharField(initial="50, 80, 100", help_text="percent, comma-separated")

    def clean_thresholds(self):
        try:
            return [int(part) for part in self.cleaned_data["thresholds"].split(",") if part.strip()]
        except ValueError:
            raise forms.ValidationError("Whole percentages, comma-separated, e.g. 50, 80, 100.") from None


@login_required
def budgets_page(request):
    form = BudgetForm(request.POST or None)
    if request.method == "POST":
        require_operator(request, "Changing budgets")
        if form.is_valid():
            created = apply_service(form, lambda: services.budget_create(actor=request.user, **form.cleaned_data))
            if created:
                messages.success(request, f"Budget added: {created}.")
                return redirect("costing:budgets")
    report, _, _ = current_report({})
    spend = {row["tenant"]: row for row in report["by_tenant"]}
    budgets = []
    for budget in Budget.objects.select_related("tenant"):
        row = spend.get(budget.tenant.name)
        used = Decimal(0)
        if row:
            used = Decimal(row["usd"]) if not budget.deployment else sum(
                (Decimal(d["usd"]) for d in row["deployments"] if d["deployment"] == budget.deployment), Decimal(0))
        percent = (used * 100 / budget.monthly_usd).quantize(Decimal("0.1"))
        budgets.append({"budget": budget, "spent": used, "percent": percent})
    return render(request, "costing/budgets.html", {"form": form, "budgets": budgets},
                  status=400 if request.method == "POST" else 200)


# ---------------------------------------------------------------------------- version comparison

NO_DATA = "no data"


def _percent(score: float | None) -> str:
    return NO_DATA if score is None else f"{score * 100:.1f} %"


def _ms(value: float | None) -> str:
    return NO_DATA if value is None else f"{value:,.0f} ms" if value >= 10 else f"{value:.2f} ms"


def _per_mtok(value: str | None) -> str:
    return NO_DATA if value is None else f"${value}"


def figure_rows(data: dict) -> list[dict]:
    """The page's table: one line per figure, both sides in words, the better one named."""
    rows = []
    for row in data["scores"]:
        a, b = row["a"], row["b"]
        rows.append({"key": f"score-{row['eval_set']}-v{row['set_version']}",
                     "label": f"Score: {row['eval_set']} v{row['set_version']} ({row['cases']} cases)",
                     "a": _percent(a and a["score"]), "b": _percent(b and b["score"]),
                     "a_run": a and a["run"], "b_run": b and b["run"], "better": row["better"], "hint": "higher"})
    for key, label in (("ttft_p95_ms", "TTFT p95"), ("tpot_p95_ms", "TPOT p95")):
        pair = data["speed"][key]
        rows.append({"key": key, "label": label, "a": _ms(pair["a"]), "b": _ms(pair["b"]), "better": pair["better"],
                     "hint": "lower"})
    for key, label in (("usd_per_mtok", "$ / 1M tokens"),
                       ("usd_per_mtok_slo_compliant", "$ / 1M SLO-compliant tokens")):
        pair = data["cost"][key]
        rows.append({"key": key, "label": label, "a": _per_mtok(pair["a"]), "b": _per_mtok(pair["b"]),
                     "better": pair["better"], "hint": "lower"})
    return rows


@login_required
def version_compare_page(request, name: str):
    model = get_object_or_404(RegisteredModel, name=name)
    context = {"model": model, "versions": list(model.versions.order_by("-number").values_list("number", flat=True)),
               "params": {key: request.GET.get(key, "") for key in ("a", "b", "days")}}
    try:
        data = versions_compare_for(name, request.GET)
    except ApiValidationError as exc:
        return render(request, "costing/compare.html", {**context, "error": _first_error(exc)}, status=400)
    chart = {"sets": [f"{row['eval_set']} v{row['set_version']}" for row in data["scores"]],
             "a": [row["a"] and row["a"]["score"] for row in data["scores"]],
             "b": [row["b"] and row["b"]["score"] for row in data["scores"]],
             "a_name": f"v{data['a']['version']}", "b_name": f"v{data['b']['version']}"}
    return render(request, "costing/compare.html", {**context, "data": data, "rows": figure_rows(data),
                                                    "chart": chart})
