"""Console pages: tenants with their limits and usage, keys created (secret shown once) and revoked."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Sum
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from deployments.models import Deployment
from inferops.forms import apply_service
from inferops.panels import tenant_panels
from inferops.roles import require_operator
from tenants import services
from tenants.api import get_key, get_tenant, tenant_queryset
from tenants.models import PRIORITY_RANGE, ApiKey, UsageMinute

USAGE_RANGES = [("1h", "last hour"), ("6h", "last 6 hours"), ("1d", "last day"), ("7d", "last 7 days")]


def limit_field(label: str) -> forms.IntegerField:
    return forms.IntegerField(label=label, min_value=1, max_value=2**31 - 1, required=False,
                              help_text="empty = unlimited")


class TenantLimitsForm(forms.Form):
    display_name = forms.CharField(max_length=200, required=False)
    rpm_limit = limit_field("Requests / minute")
    tpm_limit = limit_field("Tokens / minute")
    max_concurrent = limit_field("Concurrent requests")


class TenantForm(TenantLimitsForm):
    name = forms.SlugField(max_length=63)

    field_order = ["name", "display_name", "rpm_limit", "tpm_limit", "max_concurrent"]


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    deployments = forms.CharField(required=False, help_text="comma-separated names; empty = every deployment")
    rpm_limit = limit_field("Requests / minute")
    tpm_limit = limit_field("Tokens / minute")
    max_concurrent = limit_field("Concurrent requests")
    priority = forms.IntegerField(min_value=PRIORITY_RANGE[0], max_value=PRIORITY_RANGE[1], initial=0)
    expires_at = forms.DateTimeField(required=False, label="Expires at (UTC)",
                                     help_text="The key stops working at this moment, read as UTC whatever your "
                                               "computer's time zone; empty = the key never expires.",
                                     widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))

    def clean_deployments(self) -> list[str]:
        return [name.strip() for name in self.cleaned_data["deployments"].split(",") if name.strip()]



def last_hour_requests() -> dict[str | None, int]:
    since = timezone.now() - timedelta(hours=1)
    rows = UsageMinute.objects.filter(minute__gte=since).values("tenant").annotate(requests=Sum("requests"))
    return {row["tenant"]: row["requests"] for row in rows}


@login_required
def tenant_list(request):
    form = TenantForm(request.POST or None)
    if request.method == "POST":
        require_operator(request, "Changing tenants and keys")
        if form.is_valid():
            created = apply_service(form, lambda: services.tenant_create(actor=request.user, **form.cleaned_data))
            if created:
                messages.success(request, f"Tenant {created.name} created.")
                return redirect("tenants:detail", name=created.name)
    requests = last_hour_requests()
    tenants = [(tenant, requests.get(tenant.name, 0)) for tenant in tenant_queryset().order_by("name")]
    return render(request, "tenants/list.html", {"tenants": tenants, "form": form},
                  status=400 if request.method == "POST" else 200)


def render_detail(request, tenant, *, form=None, limits_form=None, created=None, status=200):
    limits = {field: getattr(tenant, field) for field in services.TENANT_FIELDS}
    keys = ApiKey.objects.filter(tenant=tenant).select_related("created_by")
    return render(request, "tenants/detail.html", {
        "tenant": tenant, "keys": keys, "form": form or ApiKeyForm(), "created": created, "ranges": USAGE_RANGES,
        "limits_form": limits_form or TenantLimitsForm(initial=limits, prefix="limits"),
        "deployment_names": Deployment.objects.filter(deleted_at__isnull=True).values_list("name", flat=True),
        "panels": tenant_panels.render(request, tenant),  # what the apps above tenants add (its batches)
    }, status=status)


@login_required
def tenant_detail(request, name: str):
    tenant = get_tenant(name)
    if request.method != "POST":
        return render_detail(request, tenant)
    require_operator(request, "Changing tenants and keys")
    form = ApiKeyForm(request.POST)
    if form.is_valid():
        result = apply_service(form, lambda: services.key_create(
            tenant=tenant, actor=request.user, **form.cleaned_data))
        if result:
            # Rendered into this response only, never stored (not even in the session): shown once.
            return render_detail(request, get_tenant(name), created={"key": result[0], "secret": result[1]})
    return render_detail(request, tenant, form=form, status=400)


@login_required
@require_POST
def tenant_limits(request, name: str):
    require_operator(request, "Changing tenants and keys")
    tenant = get_tenant(name)
    form = TenantLimitsForm(request.POST, prefix="limits")
    if form.is_valid():
        changes = {field: value for field, value in form.cleaned_data.items() if value != getattr(tenant, field)}
        if not changes or apply_service(form, lambda: services.tenant_update(
                tenant=tenant, actor=request.user, **changes)):
            messages.success(request, f"Limits of {name} saved: gateways apply them within seconds.")
            return redirect("tenants:detail", name=name)
    return render_detail(request, tenant, limits_form=form, status=400)


@login_required
@require_POST
def key_revoke(request, name: str, prefix: str):
    require_operator(request, "Changing tenants and keys")
    key = get_key(get_object_or_404(tenant_queryset(), name=name), prefix)
    services.key_revoke(key=key, actor=request.user)
    messages.success(request, f"Key {key.prefix} ({key.name}) revoked: gateways refuse it within seconds.")
    return redirect("tenants:detail", name=name)
