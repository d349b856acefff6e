"""The degradation panel of the alert page: the level of the alerting deployment, and for
operators a form forcing a level that posts to the console view and comes back to the alert."""

from __future__ import annotations

import pytest
from django.utils import timezone

from alerts import services as alert_services
from degradation import services
from degradation.models import DegradationState
from tests.degradation.conftest import LEVELS

pytestmark = pytest.mark.django_db
OVERRIDE = "/deployments/chat/degradation/override/"


@pytest.fixture
def alert(deployment):
    return alert_services.alert_raise(
        labels={"alertname": "HighLatency", "deployment": "chat", "severity": "page"},
        annotations={"summary": "TTFT p95 above 2 s"}, severity="page", now=timezone.now())


@pytest.fixture
def policy(deployment):
    return services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60,
                                slos=[], levels=LEVELS)


def test_no_policy_no_panel(client, make_user, alert):
    client.force_login(make_user("operator"))
    assert 'id="degradation-alert-panel"' not in client.get(f"/alerts/{alert.pk}/").content.decode()


def test_viewers_read_the_level_without_the_form(client, make_user, alert, policy):
    client.force_login(make_user("viewer"))
    html = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert 'id="alert-degradation-level"' in html and "level 0 · normal" in html
    assert 'id="alert-degradation-form"' not in html


def test_an_operator_forces_a_level_from_the_alert_page(client, make_user, deployment, alert, policy):
    client.force_login(make_user("operator"))
    html = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert 'id="alert-degradation-form"' in html and f'name="next" value="/alerts/{alert.pk}/"' in html
    response = client.post(OVERRIDE, {"override-level": "2", "override-until": "1h", "override-reason": "drill",
                                      "next": f"/alerts/{alert.pk}/"}, follow=True)
    assert response.redirect_chain[-1][0] == f"/alerts/{alert.pk}/"
    html = response.content.decode()
    assert "chat: held at level 2 (short-answers)" in html and "level 2 · short-answers" in html
    assert 'id="alert-degradation-override"' in html and "drill" in html
    assert DegradationState.objects.get(deployment=deployment).override_level == 2


def test_a_bad_level_comes_back_to_the_alert_as_a_message(client, make_user, deployment, alert, policy):
    client.force_login(make_user("operator"))
    response = client.post(OVERRIDE, {"override-level": "3", "override-until": "1h", "override-reason": "x",
                                      "next": f"/alerts/{alert.pk}/"}, follow=True)
    assert response.redirect_chain[-1][0] == f"/alerts/{alert.pk}/"
    assert "level: The policy has levels 0 to 2." in response.content.decode()
    assert not DegradationState.objects.filter(deployment=deployment, override_until__isnull=False).exists()
    # Without a next (the deployment page's own form) the errors show under the fields, as before.
    response = client.post(OVERRIDE, {"override-level": "3", "override-until": "1h", "override-reason": "x",
                                      "next": "https://evil.example/"})
    assert response.status_code == 400
