"""Console page of integrations: the outside alert sources (a team's Alertmanager) that post to
`/api/v1/alerts/alertmanager/`. Admins only, like the API: a token lets its holder raise pages.

A new integration's token is shown once, on the page that created it, with the Alertmanager
receiver configuration that uses it; only its first characters are kept to recognise it.
"""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.shortcuts import get_object_or_404, render

from alerts.inbound import alertmanager as inbound
from alerts.models import Integration
from inferops.api import Conflict
from inferops.console import console_action, tell_and_return
from inferops.roles import ADMIN, require_role
from inferops.validators import slug_validator


class IntegrationForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[slug_validator],
                           help_text="lowercase letters, digits and dashes, e.g. prod-alertmanager")


def alertmanager_config(token: str) -> str:
    """The receiver an Alertmanager needs to post here (its http_config sends the bearer token)."""
    return (f"receivers:\n"
            f"  - name: inferops\n"
            f"    webhook_configs:\n"
            f"      - url: {settings.INFEROPS_EXTERNAL_URL.rstrip('/')}/api/v1/alerts/alertmanager/\n"
            f"        send_resolved: true\n"
            f"        http_config:\n"
            f"          authorization:\n"
            f"            type: Bearer\n"
            f"            credentials: {token}\n")


@login_required
def integration_list(request):
    require_role(request, ADMIN, "Managing integrations")
    created = None
    form = IntegrationForm()
    if request.method == "POST":
        form = IntegrationForm(request.POST)
        if form.is_valid():
            try:
                integration, token = inbound.integration_create(name=form.cleaned_data["name"], actor=request.user)
            except Conflict as exc:
                form.add_error("name", str(exc.detail))
            else:
                created = {"integration": integration, "token": token, "config": alertmanager_config(token)}
                form = IntegrationForm()
    integrations = Integration.objects.annotate(alert_count=Count("alerts")).select_related("created_by")
    status = 400 if request.method == "POST" and created is None else 200
    return render(request, "alerts/integrations.html",
                  {"integrations": integrations, "form": form, "created": created}, status=status)


@console_action(ADMIN, "Deactivating an integration")
def integration_deactivate(request, pk: int):
    integration = get_object_or_404(Integration, pk=pk)
    return tell_and_return(request, lambda: inbound.integration_delete(integration=integration, actor=request.user),
                           f"Integration {integration.name} deactivated: its token no longer works.",
                           "alerts:integrations")
