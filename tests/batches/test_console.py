"""The console's batch pages: every tenant's batches with progress, counts, ETA, cost so far at the batch
price and their files; one batch in full with its cancel (an operator's, audited); downloads; the tenant
page's batches panel; and, in a real Chromium, the list's progress bar under the console's CSP."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from django.core.files.base import ContentFile
from django.test import Client
from django.utils import timezone

from batches.choices import BatchStatus, FilePurpose
from batches.models import Batch, BatchFile
from batches.services import storage
from costing.services import list_price_create
from inferops.models import AuditEvent
from tenants import services as tenant_services
from tests.browser.conftest import browser, log_in  # noqa: F401 (a fixture)

OUTPUT = b'{"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}}\n'
ERRORS = b'{"id": "batch_req_2", "custom_id": "b", "error": {"code": "server_error"}}\n'


@pytest.fixture
def fast_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def stored(tenant, content: bytes, filename: str, purpose: str = FilePurpose.BATCH_OUTPUT) -> BatchFile:
    row = BatchFile(tenant=tenant, key_prefix="k", purpose=purpose, filename=filename, bytes=len(content),
                    lines=content.count(b"\n"))
    row.storage_name = storage().save(f"files/{row.id}.jsonl", ContentFile(content))
    row.save()
    return row


def make_batch(tenant, key, **fields) -> Batch:
    now = timezone.now()
    input_file = fields.pop("input_file", None) or stored(tenant, b'{"custom_id": "a"}\n', "input.jsonl",
                                                          FilePurpose.BATCH)
    defaults = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "model": "chat",
                "status": BatchStatus.IN_PROGRESS, "expires_at": now + timedelta(days=1)}
    batch = Batch.objects.create(tenant=tenant, api_key=key, key_prefix=key.prefix, input_file=input_file,
                                 input_file_ref=input_file.id, **{**defaults, **fields})
    if "created_at" in fields:  # auto_now_add ignores it on create
        Batch.objects.filter(pk=batch.pk).update(created_at=fields["created_at"])
        batch.refresh_from_db()
    return batch


@pytest.fixture
def world(db, batch_storage, fast_hashing):
    """acme: a batch in progress (40 of 100 lines finished in 400 s, 2 M prompt and 1 M completion tokens), a
    completed one with its files, a failed one with validation errors; rival: one on a deployment with no list
    price. chat's list price is $1 / $4 per million tokens with a 50 % batch discount."""
    now = timezone.now()
    acme = tenant_services.tenant_create(name="acme", actor=None)
    rival = tenant_services.tenant_create(name="rival", actor=None)
    key, _ = tenant_services.key_create(tenant=acme, name="batch", actor=None)
    rival_key, _ = tenant_services.key_create(tenant=rival, name="batch", actor=None)
    list_price_create(deployment="chat", usd_per_mtok_prompt=Decimal(1), usd_per_mtok_completion=Decimal(4),
                      effective_from=now - timedelta(days=30), actor=None, batch_discount_percent=Decimal(50))
    done = make_batch(acme, key, status=BatchStatus.COMPLETED, total=2, completed=1, failed=1,
                      prompt_tokens=1000, completion_tokens=500, in_progress_at=now - timedelta(hours=2),
                      completed_at=now - timedelta(hours=1), created_at=now - timedelta(hours=3),
                      output_file=stored(acme, OUTPUT, "done_output.jsonl"),
                      error_file=stored(acme, ERRORS, "done_error.jsonl"))
    failed = make_batch(acme, key, status=BatchStatus.FAILED, model="", total=3, failed_at=now,
                        created_at=now - timedelta(hours=2),
                        errors={"object": "list", "data": [{"code": "invalid_json", "message": "Line 2 is not JSON.",
                                                            "param": None, "line": 2}]})
    other = make_batch(rival, rival_key, model="other", total=10, completed=5, prompt_tokens=10,
                       in_progress_at=now - timedelta(seconds=50), created_at=now - timedelta(hours=1))
    running = make_batch(acme, key, total=100, completed=30, failed=10, prompt_tokens=2_000_000,
                         completion_tokens=1_000_000, in_progress_at=now - timedelta(seconds=400),
                         metadata={"job": "nightly-eval"})
    return {"acme": acme, "rival": rival, "key": key, "running": running, "done": done, "failed": failed,
            "other": other}


def signed_in(make_user, role: str | None) -> Client:
    client = Client()
    client.force_login(make_user(role))
    return client


def rows(html: str) -> list[str]:
    return re.findall(r'<tr data-batch="([^"]+)"', html)


def row_html(html: str, batch_id: str) -> str:
    return re.search(rf'<tr data-batch="{batch_id}".*?</tr>', html, re.S).group(0)


def test_the_list_shows_each_batch_progress_eta_cost_and_files_newest_first(world, make_user):
    html = signed_in(make_user, "viewer").get("/batches/").content.decode()
    assert rows(html) == [world[name].id for name in ("running", "other", "failed", "done")]

    running = row_html(html, world["running"].id)
    assert 'data-percent="40"' in running and 'style="width:30%"' in running and 'style="width:10%"' in running
    assert "30 / 10 / 100" in running and ">acme</a>" in running and "chat" in running
    # 40 lines in 400 s: 60 left at 0.1 line/s.
    assert '<td class="batch-eta">10m</td>' in running
    # 2 M prompt tokens at $0.50 and 1 M completion tokens at $2.00 (the list price less 50 %).
    assert "$3.0000" in running
    assert "download-output" not in running

    done = row_html(html, world["done"].id)
    assert '<td class="batch-eta">—</td>' in done and "1 / 1 / 2" in done
    assert f'href="/batches/files/{world["done"].output_file_id}/download/"' in done
    assert f'href="/batches/files/{world["done"].error_file_id}/download/"' in done
    assert "no list price" in row_html(html, world["other"].id)
    assert 'data-percent="0"' in row_html(html, world["failed"].id)


def test_the_list_filters_by_tenant_and_status(world, make_user):
    client = signed_in(make_user, "viewer")
    assert rows(client.get("/batches/?tenant=rival").content.decode()) == [world["other"].id]
    assert rows(client.get("/batches/?tenant=acme&status=completed").content.decode()) == [world["done"].id]
    assert rows(client.get("/batches/?status=in_progress").content.decode()) == [
        world["running"].id, world["other"].id]
    assert rows(client.get("/batches/?tenant=nobody").content.decode()) == []
    # An unknown status filters nothing; the form shows the filters that apply.
    assert len(rows(client.get("/batches/?status=bogus").content.decode())) == 4
    html = client.get("/batches/?tenant=rival&status=in_progress").content.decode()
    assert '<option value="rival" selected>' in html and '<option value="in_progress" selected>' in html


def test_the_list_is_paginated(world, make_user):
    Batch.objects.bulk_create([Batch(tenant=world["acme"], key_prefix="k", endpoint="/v1/chat/completions",
                                     completion_window="24h", expires_at=timezone.now(), input_file_ref="f")
                               for _ in range(50)])
    client = signed_in(make_user, "viewer")
    first = client.get("/batches/").content.decode()
    assert len(rows(first)) == 50 and "page 1 of 2" in first
    assert len(rows(client.get("/batches/?page=2").content.decode())) == 4


def test_who_opens_the_batch_pages(world, make_user):
    paths = ["/batches/", f"/batches/{world['running'].id}/",
             f"/batches/files/{world['done'].output_file_id}/download/"]
    viewer, nobody, anonymous = signed_in(make_user, "viewer"), signed_in(make_user, None), Client()
    for path in paths:
        assert viewer.get(path).status_code == 200, path
        assert nobody.get(path).status_code == 403, path
        response = anonymous.get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/"), path
    assert viewer.get("/batches/batch_nope/").status_code == 404
    assert viewer.get("/batches/files/file-nope/download/").status_code == 404


def test_the_detail_page_shows_progress_cost_at_the_batch_price_times_and_files(world, make_user):
    running = world["running"]
    Batch.objects.filter(pk=running.pk).update(last_error="Waiting: no replica of chat is ready.")
    html = signed_in(make_user, "viewer").get(f"/batches/{running.id}/").content.decode()
    assert 'id="batch-last-error"' in html and "Waiting: no replica of chat is ready." in html
    assert "Not making progress" in html
    assert 'data-finished="40" data-total="100"' in html and "30 completed · 10 failed · 100 total" in html
    assert re.search(r'id="batch-eta">10m ', html)
    assert "2,000,000 prompt · 1,000,000 completion" in html
    assert "$3.0000" in html and "$0.5000 / $2.0000 per million" in html
    assert "list price $1.0000 / $4.0000" in html and "less its 50 % batch discount" in html
    assert "nightly-eval" in html
    assert f'href="/batches/files/{running.input_file_id}/download/"' in html
    assert 'data-live="3"' in html  # it refreshes while the batch runs
    assert 'id="batch-cancel"' not in html  # a viewer's page has no cancel

    done = signed_in(make_user, "operator").get(f"/batches/{world['done'].id}/").content.decode()
    assert f'/batches/files/{world["done"].output_file_id}/download/' in done
    assert f'/batches/files/{world["done"].error_file_id}/download/' in done
    assert 'id="batch-cancel"' not in done and 'data-live="' not in done  # finished: nothing to cancel or refresh


def test_a_failed_batch_shows_why_validation_failed(world, make_user):
    html = signed_in(make_user, "viewer").get(f"/batches/{world['failed'].id}/").content.decode()
    assert 'id="batch-errors"' in html and "Line 2 is not JSON." in html and "invalid_json" in html


def test_an_operator_cancels_a_running_batch_and_the_audit_log_says_who(world, make_user):
    running = world["running"]
    operator = signed_in(make_user, "operator")
    page_html = operator.get(f"/batches/{running.id}/").content.decode()
    form = re.search(r'<form method="post" action="([^"]+)" id="batch-cancel" data-confirm="([^"]+)"', page_html)
    assert form and form.group(1) == f"/batches/{running.id}/" and "Cancel batch" in form.group(2)

    viewer = signed_in(make_user, "viewer")
    assert viewer.post(f"/batches/{running.id}/").status_code == 403
    assert Client().post(f"/batches/{running.id}/")["Location"].startswith("/login/")
    running.refresh_from_db()
    assert running.status == BatchStatus.IN_PROGRESS

    response = operator.post(f"/batches/{running.id}/", follow=True)
    assert response.redirect_chain[-1] == (f"/batches/{running.id}/", 302)
    assert "cancel asked" in response.content.decode()
    running.refresh_from_db()
    assert running.status == BatchStatus.CANCELLING and running.cancelling_at is not None
    event = AuditEvent.objects.get(action="batch.cancel")
    assert (event.actor_name, event.object_id) == ("operator-user", running.id)
    assert (event.before["status"], event.after["status"]) == ("in_progress", "cancelling")

    # A finished batch is not cancelled: the page says why, and nothing is audited.
    done = world["done"]
    refused = operator.post(f"/batches/{done.id}/", follow=True).content.decode()
    assert "only a validating or in-progress batch can be cancelled" in refused
    done.refresh_from_db()
    assert done.status == BatchStatus.COMPLETED and AuditEvent.objects.filter(action="batch.cancel").count() == 1


def test_a_download_is_the_stored_bytes_as_an_attachment(world, make_user):
    response = signed_in(make_user, "viewer").get(f"/batches/files/{world['done'].output_file_id}/download/")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == OUTPUT
    assert response["Content-Disposition"] == 'attachment; filename="done_output.jsonl"'


def test_the_tenant_page_lists_its_batches(world, make_user):
    html = signed_in(make_user, "viewer").get("/tenants/acme/").content.decode()
    panel = re.search(r'<section class="tenant-batches" id="tenant-batches">.*?</section>', html, re.S).group(0)
    assert rows(panel) == [world[name].id for name in ("running", "failed", "done")]
    running = row_html(panel, world["running"].id)
    assert 'data-percent="40"' in running and "30 / 10 / 100" in running and "10m" in running
    assert "$3.0000" in running
    assert f'/batches/files/{world["done"].output_file_id}/download/' in panel
    assert 'href="/batches/?tenant=acme"' in panel
    assert world["other"].id not in panel
    # A tenant without batches says so.
    rival_free = signed_in(make_user, "operator").get("/tenants/rival/").content.decode()
    assert 'id="tenant-batches"' in rival_free


WATCH_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", e => window.__csp.push(e.violatedDirective));
"""


@pytest.mark.browser
# reset_sequences: the flush after it makes the role groups again from id 1, never at the ids from 1001 that
# tests/test_api_status_matrix.py's objects take (tests/reliability/test_permissions.py makes groups there).
@pytest.mark.django_db(transaction=True, reset_sequences=True)
def test_the_list_draws_the_progress_bar_under_the_policy(live_server, browser, batch_storage,  # noqa: F811
                                                          fast_hashing):
    now = timezone.now()
    acme = tenant_services.tenant_create(name="acme", actor=None)
    key, _ = tenant_services.key_create(tenant=acme, name="batch", actor=None)
    running = make_batch(acme, key, total=8, completed=2, failed=2, in_progress_at=now - timedelta(seconds=40))
    User.objects.create_user("ops", password="pw-12345678").groups.add(Group.objects.get(name="operator"))
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(WATCH_VIOLATIONS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        log_in(page, live_server.url, "ops", "pw-12345678")
        page.click("header nav >> text=Batches")
        row = page.locator(f'tr[data-batch="{running.id}"]')
        bar = row.locator(".batch-progress")
        bar.wait_for()
        done_width = bar.locator(".done").evaluate("el => el.getBoundingClientRect().width")
        whole = bar.evaluate("el => el.getBoundingClientRect().width")
        assert whole > 0 and abs(done_width / whole - 0.25) < 0.02  # 2 of 8 completed
        assert bar.get_attribute("aria-valuenow") == "4"
        assert re.fullmatch(r"\d+s", row.locator(".batch-eta").inner_text())  # 4 lines in 40 s and more, 4 left
        page.click(f'tr[data-batch="{running.id}"] a >> text={running.id}')
        page.wait_for_selector("#batch-cancel")
        page.wait_for_timeout(200)  # violations are reported asynchronously
        assert page.evaluate("window.__csp") == [] and errors == []
    finally:
        context.close()
