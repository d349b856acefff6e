"""The audit log in a real Chromium: a create lists what was set, not every empty field, and text
in any script reads as written, in plain values and inside JSON alike."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

from inferops.audit import audit_record, snapshot
from tenants.services import tenant_create
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_create_row_lists_what_was_set_and_unicode_reads_as_written(live_server, page, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = User.objects.create_user("root", password="pw-root-123456")
    admin.groups.add(Group.objects.get(name="admin"))
    tenant = tenant_create(name="cafe", actor=admin, display_name="Café Zürich ☕", rpm_limit=600)
    before = snapshot(tenant)
    audit_record(actor=admin, action="tenant.update", obj=tenant, before=before,
                 after={**before, "labels": {"équipe": "données", "city": "東京"}})

    log_in(page, live_server.url, "root", "pw-root-123456")
    page.goto(f"{live_server.url}/audit/?action=tenant.create")
    created = page.locator("tr.audit-event").filter(has_text="tenant.create")
    fields = created.locator(".change strong").all_inner_texts()
    assert {"name", "display_name", "rpm_limit"} <= set(fields)
    # Limits left unset (null) and empty fields are not changes anyone reads.
    assert not {"tpm_limit", "max_concurrent"} & set(fields), fields
    assert "Café Zürich ☕" in created.inner_text()

    page.goto(f"{live_server.url}/audit/?action=tenant.update")
    change = page.locator("tr.audit-event .change").filter(has_text="labels").inner_text()
    assert '"équipe": "données"' in change and '"city": "東京"' in change
    assert "\\u" not in change
