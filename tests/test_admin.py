"""Writes in Django's admin go through the apps' services: validated, audited, and followed by what
the service does after a write (API keys republished when a tenant's limits change)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from inferops.models import AuditEvent
from inferops.redis_client import redis_client
from registry import services as registry_services
from registry.models import Alias
from runtime.gateway.contract import KEYS_KEY
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db(transaction=True)  # the key table is published on commit


@pytest.fixture
def admin_client(client):
    client.force_login(User.objects.create_superuser("root", password="pw-12345678"))
    return client


def tenant_form(tenant: Tenant, **changes) -> dict:
    return {"display_name": tenant.display_name, "rpm_limit": tenant.rpm_limit or "",
            "tpm_limit": tenant.tpm_limit or "", "max_concurrent": tenant.max_concurrent or "", **changes}


def test_a_tenant_changed_in_the_admin_is_audited_and_its_keys_republished(admin_client):
    tenant = tenant_services.tenant_create(name="acme", actor=None, rpm_limit=10)
    key, secret = tenant_services.key_create(tenant=tenant, name="ci", actor=None)
    response = admin_client.post(f"/admin/tenants/tenant/{tenant.pk}/change/", tenant_form(tenant, rpm_limit=99))
    assert response.status_code == 302, response.content.decode()[:2000]
    event = AuditEvent.objects.filter(action="tenant.update").get()
    assert event.actor_name == "root" and event.before["rpm_limit"] == 10 and event.after["rpm_limit"] == 99
    published = json.loads(redis_client().hget(KEYS_KEY, key.key_hash))
    assert published["limits"]["tenant"]["rpm"] == 99


def test_a_refusal_of_the_service_is_shown_not_a_server_error(admin_client):
    chat = registry_services.model_create(name="chat", task="generate", actor=None)
    other = registry_services.model_create(name="other", task="generate", actor=None)
    foreign = make_version(other, 1)
    response = admin_client.post("/admin/registry/alias/add/",
                                 {"model": chat.pk, "name": "champion", "version": foreign.pk}, follow=True)
    assert response.status_code == 200
    assert "Not saved: Version 1 belongs to another model." in response.content.decode()
    assert not Alias.objects.exists() and not AuditEvent.objects.filter(action="alias.set")


def test_what_only_the_platform_writes_is_read_only_in_the_admin(admin_client):
    for page in ("/admin/inferops/auditevent/add/", "/admin/tenants/apikey/add/",
                 "/admin/deployments/replica/add/", "/admin/deployments/deployment/add/"):
        assert admin_client.get(page).status_code == 403, page


def test_users_groups_and_api_tokens_written_in_the_admin_are_audited(admin_client):
    """Issue 40 (the permissions table's audit check): Django's own admin pages wrote users, their roles
    (groups) and API tokens with no audit event."""
    from django.contrib.auth.models import Group
    from rest_framework.authtoken.models import Token

    response = admin_client.post("/admin/auth/user/add/", {
        "username": "ana", "password1": "a-long-pass-phrase-1", "password2": "a-long-pass-phrase-1",
        "usable_password": "true"})
    assert response.status_code == 302, response.content.decode()[:2000]
    ana = User.objects.get(username="ana")
    response = admin_client.post(f"/admin/auth/user/{ana.pk}/password/", {
        "password1": "another-pass-phrase-2", "password2": "another-pass-phrase-2", "usable_password": "true"})
    assert response.status_code == 302
    response = admin_client.post("/admin/auth/group/add/", {"name": "auditors"})
    assert response.status_code == 302
    response = admin_client.post("/admin/authtoken/tokenproxy/add/", {"user": ana.pk})
    assert response.status_code == 302
    key = Token.objects.get(user=ana).key
    response = admin_client.post(f"/admin/auth/group/{Group.objects.get(name='auditors').pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    events = list(AuditEvent.objects.order_by("pk").values_list("action", "actor_name", "object_repr"))
    assert events == [("user.create", "root", "ana"), ("user.update", "root", "ana"),
                      ("group.create", "root", "auditors"), ("token.create", "root", "ana"),
                      ("group.delete", "root", "auditors")]
    assert key not in json.dumps(list(AuditEvent.objects.values("object_repr", "before", "after")))


def test_a_deployment_with_rollouts_is_deleted_in_the_admin_through_its_service(admin_client):
    """Issue 40 (the permissions table's audit check): the admin offered delete and then refused it (403)
    because the rows it would cascade to (rollouts, replicas) have read-only admin pages; the service
    marks the deployment deleted and keeps them."""
    from deployments.models import Deployment, Rollout

    model = registry_services.model_create(name="chat", task="generate", actor=None)
    v1, v2 = make_version(model, 1), make_version(model, 2)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=1)
    Rollout.objects.create(deployment=deployment, stable_version=v1, candidate_version=v2,
                           step_started_at=timezone.now())
    response = admin_client.post(f"/admin/deployments/deployment/{deployment.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302, response.status_code
    deployment.refresh_from_db()
    assert deployment.deleted_at is not None and Rollout.objects.filter(deployment=deployment).exists()
    assert AuditEvent.objects.filter(action="deployment.delete", actor_name="root").exists()
