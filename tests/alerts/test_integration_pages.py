"""The integrations console page: admins create one (its token shown once, with the Alertmanager
receiver configuration that uses it), see what each posted, and deactivate it; nobody else may."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from alerts.models import Alert, Integration
from inferops.models import AuditEvent
from tests.alerts.test_inbound import URL, am_alert, payload

pytestmark = pytest.mark.django_db


def test_an_admin_creates_an_integration_whose_token_works_once_shown(client, make_user, settings):
    settings.INFEROPS_EXTERNAL_URL = "https://inferops.example"
    client.force_login(make_user("admin", "root"))
    page = client.post("/alerts/integrations/", {"name": "prod-am"})
    assert page.status_code == 200
    token = page.context["created"]["token"]
    text = page.content.decode()
    assert token in text and "url: https://inferops.example/api/v1/alerts/alertmanager/" in text
    assert f"credentials: {token}" in text and "type: Bearer" in text

    # The token works at the Alertmanager endpoint, and the page counts what it posted.
    sender = APIClient()
    sender.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert sender.post(URL, payload("firing", [am_alert("firing", "NodeDown", "critical", "n1")]),
                       format="json").status_code == 200
    listing = client.get("/alerts/integrations/")
    assert token not in listing.content.decode()  # shown once, never again
    assert listing.context["integrations"][0].alert_count == 1
    assert list(client.get("/alerts/?integration=prod-am").context["page"]) == list(Alert.objects.all())

    # A taken name is an error on the form, not a 500; nothing is written.
    again = client.post("/alerts/integrations/", {"name": "prod-am"})
    assert again.status_code == 400 and "already exists" in again.content.decode()
    assert client.post("/alerts/integrations/", {"name": "Not A Slug"}).status_code == 400
    assert Integration.objects.count() == 1

    integration = Integration.objects.get()
    assert client.post(f"/alerts/integrations/{integration.pk}/deactivate/").status_code == 302
    assert not Integration.objects.get().active
    assert sender.post(URL, payload("firing", [am_alert("firing", "NodeDown", "critical", "n2")]),
                       format="json").status_code == 401
    assert AuditEvent.objects.filter(action__in=["integration.create", "integration.deactivate"]).count() == 2


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_only_admins_manage_integrations(client, make_user, role):
    client.force_login(make_user(role))
    assert client.get("/alerts/integrations/").status_code == 403
    assert client.post("/alerts/integrations/", {"name": "sneaky"}).status_code == 403
    assert not Integration.objects.exists()
