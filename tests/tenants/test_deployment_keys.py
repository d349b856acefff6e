"""The deployment page lists who may call it (tenants/panels.py): the active keys scoped to it, each
linking to its tenant, and in one line the unscoped keys that reach every deployment; never a
secret, never a revoked or expired key, never a key scoped to other deployments only."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import panels
from tenants.models import ApiKey
from tenants.services import key_create, key_revoke, tenant_create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def keys(deployments, redis_conn):
    acme = tenant_create(name="acme", actor=None)
    beta = tenant_create(name="beta", actor=None)
    made = {
        "ci": key_create(tenant=acme, name="ci", actor=None, deployments=["chat"]),
        "both": key_create(tenant=beta, name="both", actor=None, deployments=["chat", "embed"]),
        "embed-only": key_create(tenant=beta, name="embed-only", actor=None, deployments=["embed"]),
        "acme-all": key_create(tenant=acme, name="acme-all", actor=None),
        "acme-all-2": key_create(tenant=acme, name="acme-all-2", actor=None),
        "beta-all": key_create(tenant=beta, name="beta-all", actor=None),
        "revoked": key_create(tenant=acme, name="revoked", actor=None, deployments=["chat"]),
        "expired": key_create(tenant=acme, name="expired", actor=None, deployments=["chat"]),
    }
    key_revoke(key=made["revoked"][0], actor=None)
    ApiKey.objects.filter(pk=made["expired"][0].pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    return made


def test_the_deployment_page_lists_the_keys_scoped_to_it_and_counts_the_unscoped(client, make_user, keys):
    client.force_login(make_user("viewer"))
    page = client.get("/deployments/chat/").content.decode()
    panel = page[page.index('id="keys-panel"'):]
    panel = panel[:panel.index("</section>")]

    listed = re.findall(r'data-prefix="([^"]+)"', panel)
    assert listed == [keys["ci"][0].prefix, keys["both"][0].prefix]  # by tenant, then name
    assert 'href="/tenants/acme/#keys"' in panel and 'href="/tenants/beta/#keys"' in panel
    assert '<span class="pill">embed</span>' in panel  # what the beta key also reaches
    assert all(secret not in page for _, secret in keys.values())
    unscoped = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", panel[panel.index('id="unscoped-keys"'):]))
    assert "3 keys with no deployment scope reach every deployment, this one included: acme (2), beta (1)." in unscoped


def test_a_deployment_no_key_is_scoped_to_says_so(client, make_user, deployments, redis_conn):
    client.force_login(make_user("viewer"))
    page = client.get("/deployments/embed/").content.decode()
    assert "No active key is limited to embed." in page
    assert "No key reaches every deployment" in page


def test_long_lists_are_cut_with_a_count(client, make_user, deployments, redis_conn, monkeypatch):
    monkeypatch.setattr(panels, "SHOWN", 1)
    monkeypatch.setattr(panels, "TENANTS_SHOWN", 1)
    for name in ("acme", "beta", "gamma"):
        tenant = tenant_create(name=name, actor=None)
        key_create(tenant=tenant, name="scoped", actor=None, deployments=["chat"])
        key_create(tenant=tenant, name="everything", actor=None)
    client.force_login(make_user("viewer"))
    page = client.get("/deployments/chat/").content.decode()
    assert page.count("data-prefix=") == 1 and "and 2 more: see each tenant" in page
    assert "acme</a> (1) and 2 more tenants." in page
