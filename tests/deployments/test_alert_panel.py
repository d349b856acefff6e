"""The deployment panel of the alert page: the alerting deployment's replicas and recent rollouts,
and for operators abort / undo forms that post to the rollout views and come back to the alert."""

from __future__ import annotations

import pytest
from django.utils import timezone

from alerts import services as alert_services
from deployments.choices import RolloutStatus
from deployments.models import Deployment, Replica, Rollout
from deployments.rollouts import services as rollouts
from registry.models import RegisteredModel
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment() -> Deployment:
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1 = make_version(model, 1)
    make_version(model, 2)
    return Deployment.objects.create(name="chat", model=model, version=v1, replicas=2)


@pytest.fixture
def alert(deployment):
    return alert_services.alert_raise(
        labels={"alertname": "HighErrorRate", "deployment": "chat", "severity": "page"},
        annotations={"summary": "5xx above 5% on chat"}, severity="page", now=timezone.now())


def page_of(client, alert) -> str:
    response = client.get(f"/alerts/{alert.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def test_the_panel_shows_replicas_and_rollouts_and_viewers_get_no_remedies(client, make_user, deployment, alert):
    Replica.objects.create(deployment=deployment, version=deployment.version, node="local", state="ready")
    Replica.objects.create(deployment=deployment, version=deployment.version, node="local", state="failed",
                           restarts=3, crash_looping=True, last_error="CUDA out of memory while loading")
    Replica.objects.create(deployment=deployment, version=deployment.version, node="local", state="stopped")
    rollout = rollouts.rollout_create(deployment=deployment, actor=None, version=2)
    client.force_login(make_user("viewer"))
    html = page_of(client, alert)
    assert 'id="deployment-panel"' in html and "serves v1 of tiny" in html
    assert html.count('data-state="') == 2  # stopped replicas are left out
    assert "crash-looping" in html and "CUDA out of memory while loading" in html and "3 restart(s)" in html
    assert f'href="/deployments/chat/rollouts/{rollout.pk}/">rollout {rollout.pk}</a>' in html
    assert 'id="deployment-remedies"' not in html


def test_an_operator_aborts_the_running_rollout_from_the_alert(client, make_user, deployment, alert):
    rollout = rollouts.rollout_create(deployment=deployment, actor=None, version=2)
    client.force_login(make_user("operator"))
    html = page_of(client, alert)
    assert f'action="/deployments/chat/rollouts/{rollout.pk}/abort/"' in html
    assert f'name="next" value="/alerts/{alert.pk}/"' in html and 'id="remedy-undo"' not in html
    response = client.post(f"/deployments/chat/rollouts/{rollout.pk}/abort/",
                           {"reason": "alert says so", "next": f"/alerts/{alert.pk}/"}, follow=True)
    assert response.redirect_chain[-1][0] == f"/alerts/{alert.pk}/"
    assert f"Rollout {rollout.pk} aborted" in response.content.decode()
    rollout.refresh_from_db()
    assert rollout.status == RolloutStatus.ABORTED and "alert says so" in rollout.message
    assert 'id="remedy-none"' in response.content.decode()


def test_an_operator_undoes_the_last_rollout_from_the_alert(client, make_user, deployment, alert):
    done = rollouts.rollout_create(deployment=deployment, actor=None, version=2)
    Rollout.objects.filter(pk=done.pk).update(status=RolloutStatus.SUCCEEDED, finished_at=timezone.now(), weight=100)
    Deployment.objects.filter(pk=deployment.pk).update(version=done.candidate_version)
    client.force_login(make_user("operator"))
    html = page_of(client, alert)
    assert "Undo the last rollout: roll back to v1" in html
    response = client.post("/deployments/chat/rollouts/undo/", {"next": f"/alerts/{alert.pk}/"})
    assert response["Location"] == f"/alerts/{alert.pk}/"
    rollback = Rollout.objects.order_by("-id").first()
    assert rollback.rollback and rollback.candidate_version.number == 1


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/x", "javascript:alert(1)"])
def test_a_next_elsewhere_is_ignored(client, make_user, deployment, target):
    rollout = rollouts.rollout_create(deployment=deployment, actor=None, version=2)
    client.force_login(make_user("operator"))
    response = client.post(f"/deployments/chat/rollouts/{rollout.pk}/abort/", {"next": target})
    assert response["Location"] == f"/deployments/chat/rollouts/{rollout.pk}/"
    response = client.post("/deployments/chat/rollouts/undo/", {"next": target})
    assert response["Location"] == "/deployments/chat/"  # nothing left to undo: the deployment's page
