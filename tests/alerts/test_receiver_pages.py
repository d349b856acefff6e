"""Receiver pages: admins list, add, edit and delete receivers of every kind; the PagerDuty key is
write-only; what the API refuses is refused on the form, named, with nothing written."""

from __future__ import annotations

import pytest

from alerts.models import Receiver
from alerts.routing.services import route_save
from inferops.models import AuditEvent
from tests.conftest import text_of

pytestmark = pytest.mark.django_db

KEY = "R0UT1NGKEY-abcdefgh-1234"


@pytest.fixture
def admin(client, make_user):
    client.force_login(make_user("admin"))
    return client


def form(**fields) -> dict:
    return {"name": "team-hook", "kind": "webhook", "url": "", "routing_key": "", "to": "", "send_resolved": "on",
            "active": "on", **fields}


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_below_admin_sees_no_forms_and_is_refused(client, make_user, role):
    receiver = Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    client.force_login(make_user(role))
    assert client.get("/alerts/receivers/").status_code == 403
    assert client.get("/alerts/receivers/new/").status_code == 403
    assert client.post("/alerts/receivers/new/", form(url="http://127.0.0.1:9/x")).status_code == 403
    assert client.post(f"/alerts/receivers/{receiver.pk}/edit/", form(name="hook", url="http://e/x")).status_code == 403
    assert client.post(f"/alerts/receivers/{receiver.pk}/delete/").status_code == 403
    assert list(Receiver.objects.values_list("name", "url")) == [("hook", "http://127.0.0.1:9/hook")]


def test_admin_adds_each_kind_and_lists_them(admin):
    for fields in [form(url="http://127.0.0.1:9/hook"),
                   form(name="pager", kind="pagerduty", routing_key=KEY, to="x@example.com"),
                   form(name="chat", kind="slack", url="http://127.0.0.1:9/slack"),
                   form(name="oncall-mail", kind="email", to="a@example.com\nb@example.com, a@example.com",
                        send_resolved="")]:
        response = admin.post("/alerts/receivers/new/", fields)
        assert response.status_code == 302, text_of(response)
    pager = Receiver.objects.get(name="pager")
    assert (pager.routing_key, pager.url, pager.to) == (KEY, "", [])  # only its kind's fields are kept
    mail = Receiver.objects.get(name="oncall-mail")
    assert (mail.to, mail.send_resolved, mail.url) == (["a@example.com", "b@example.com"], False, "")
    page = text_of(admin.get("/alerts/receivers/"))
    assert "a@example.com, b@example.com" in page and "key stored" in page and "http://127.0.0.1:9/slack" in page
    assert KEY not in page
    assert AuditEvent.objects.filter(action="receiver.create").count() == 4
    assert KEY not in str(list(AuditEvent.objects.values_list("after", flat=True)))


def test_the_routing_key_is_write_only_and_kept_when_left_empty(admin):
    pager = Receiver.objects.create(name="pager", kind="pagerduty", routing_key=KEY)
    page = text_of(admin.get(f"/alerts/receivers/{pager.pk}/edit/"))
    assert KEY not in page and "a key ending …1234 is stored" in page
    response = admin.post(f"/alerts/receivers/{pager.pk}/edit/", form(name="pager", kind="pagerduty", active=""))
    assert response.status_code == 302
    pager.refresh_from_db()
    assert (pager.routing_key, pager.active) == (KEY, False)
    admin.post(f"/alerts/receivers/{pager.pk}/edit/", form(name="pager", kind="pagerduty", routing_key="NEW-KEY"))
    pager.refresh_from_db()
    assert pager.routing_key == "NEW-KEY"
    # Another kind drops the key, as the API does.
    admin.post(f"/alerts/receivers/{pager.pk}/edit/", form(name="pager", kind="webhook", url="http://127.0.0.1:9/h"))
    pager.refresh_from_db()
    assert (pager.kind, pager.routing_key, pager.url) == ("webhook", "", "http://127.0.0.1:9/h")


def test_a_pagerduty_receiver_opens_incidents_per_group_or_per_alert_as_chosen(admin):
    response = admin.post("/alerts/receivers/new/", form(name="pager", kind="pagerduty", routing_key=KEY,
                                                         incident_per="alert"))
    assert response.status_code == 302, text_of(response)
    pager = Receiver.objects.get(name="pager")
    assert pager.incident_per == "alert"
    assert "one incident per alert" in text_of(admin.get("/alerts/receivers/"))
    edit = admin.get(f"/alerts/receivers/{pager.pk}/edit/").content.decode()
    assert '<option value="alert" selected>One incident per alert</option>' in edit
    # A form that leaves the choice out (or an older page) keeps the default: per group.
    fields = form(name="pager", kind="pagerduty")
    del fields["routing_key"]
    assert admin.post(f"/alerts/receivers/{pager.pk}/edit/", {**fields, "incident_per": ""}).status_code == 302
    pager.refresh_from_db()
    assert (pager.incident_per, pager.routing_key) == ("group", KEY)
    response = admin.post(f"/alerts/receivers/{pager.pk}/edit/", {**fields, "incident_per": "service"})
    assert response.status_code == 400 and "Select a valid choice. service is not one" in text_of(response)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"url": ""}, "A webhook receiver needs the URL to POST to."),
    ({"url": "not a url"}, "not a url: Enter a valid URL."),
    ({"name": "Team Hook", "url": "http://127.0.0.1:9/h"}, "Team Hook: Use 1-63 lowercase letters"),
    ({"kind": "pagerduty"}, "A PagerDuty receiver needs its integration key."),
    ({"kind": "slack"}, "A Slack receiver needs its incoming webhook URL."),
    ({"kind": "email"}, "An email receiver needs at least one address."),
    ({"kind": "email", "to": "ops@example.com, nobody-at-example"}, "Not an email address: nobody-at-example."),
    ({"kind": "carrier-pigeon"}, "Select a valid choice. carrier-pigeon is not one of the available choices."),
])
def test_bad_input_is_named_and_nothing_is_written(admin, fields, expected):
    response = admin.post("/alerts/receivers/new/", form(**fields))
    assert response.status_code == 400
    page = text_of(response)
    assert expected in page
    assert "routing_key:" not in page and "need to:" not in page
    assert not Receiver.objects.exists() and not AuditEvent.objects.exists()


def test_a_taken_name_and_a_receiver_in_use_are_conflicts_shown(admin):
    hook = Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    response = admin.post("/alerts/receivers/new/", form(name="hook", url="http://127.0.0.1:9/other"))
    assert response.status_code == 400 and "A receiver named 'hook' already exists." in text_of(response)
    route = route_save(instance=None, actor=None, fields={"receiver": hook, "matchers": []})
    response = admin.post(f"/alerts/receivers/{hook.pk}/delete/", follow=True)
    assert f"Receiver 'hook' is the receiver of route {route.pk}: point them elsewhere first." in text_of(response)
    assert Receiver.objects.filter(pk=hook.pk).exists()
    route.delete()
    response = admin.post(f"/alerts/receivers/{hook.pk}/delete/", follow=True)
    assert "Receiver hook deleted." in text_of(response)
    assert not Receiver.objects.exists()
    assert AuditEvent.objects.filter(action="receiver.delete").count() == 1


@pytest.mark.parametrize(("target", "lands"), [
    ("/alerts/routes/new/", "/alerts/routes/new/?receiver=team-hook"),
    ("/alerts/routes/3/edit/?receiver=old", "/alerts/routes/3/edit/?receiver=team-hook"),
    ("https://evil.example/steal", "/alerts/receivers/"),  # not this site: ignored
    ("//evil.example/steal", "/alerts/receivers/"),
    ("javascript:alert(1)", "/alerts/receivers/"),
])
def test_saving_returns_to_a_local_next_only(admin, target, lands):
    page = admin.get("/alerts/receivers/new/", {"next": target}).content.decode()
    assert ('name="next"' in page) is lands.startswith("/alerts/routes/")
    answer = admin.post("/alerts/receivers/new/", form(url="http://127.0.0.1:9/hook", next=target))
    assert answer.status_code == 302 and answer["Location"] == lands


def test_the_route_form_offers_to_add_a_receiver(client, make_user):
    client.force_login(make_user("admin"))
    page = text_of(client.get("/alerts/routes/new/"))
    assert "No receiver exists yet" in page and 'href="/alerts/receivers/new/?next=/alerts/routes/new/"' in page
    Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    assert "No receiver exists yet" not in text_of(client.get("/alerts/routes/new/"))
    client.force_login(make_user("operator"))  # may edit routes, not receivers: told who can
    page = text_of(client.get("/alerts/routes/new/"))
    assert "An admin adds receivers" in page and "receiver-add-link" not in page
