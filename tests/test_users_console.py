"""The users console (admins only): create with a typed or generated password, change a role,
deactivate, refusals for one's own account and superusers; and the 403 page names the role needed."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from inferops.models import AuditEvent
from inferops.roles import user_role

pytestmark = pytest.mark.django_db


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_non_admin_gets_the_403_page_naming_the_role(make_user):
    response = client_for(make_user("operator")).get("/users/")
    assert response.status_code == 403
    page = response.content.decode()
    assert "Managing users needs the admin role." in page
    assert "with the operator role" in page and "<nav" in page  # in the console's layout


def test_a_user_without_a_role_is_told_so(make_user):
    response = client_for(make_user(None)).get("/users/")
    assert response.status_code == 403
    assert "with no role yet" in response.content.decode()


def test_an_admin_creates_a_user_with_a_generated_password_shown_once(make_user):
    admin = client_for(make_user("admin"))
    response = admin.post("/users/", {"username": "dana", "email": "dana@example.com", "role": "operator"})
    assert response.status_code == 200
    page = response.content.decode()
    created = User.objects.get(username="dana")
    assert user_role(created) == "operator"
    password = page.split('id="initial-password">')[1].split("<")[0]
    assert len(password) >= 12 and created.check_password(password)
    event = AuditEvent.objects.get(action="user.create")
    assert event.after == {"username": "dana", "email": "dana@example.com", "role": "operator", "is_active": True}
    assert password not in str(event.before) + str(event.after)
    # The list shows them; the password is not shown again.
    assert password not in admin.get("/users/").content.decode()


def test_bad_input_names_what_was_typed(make_user):
    admin = client_for(make_user("admin"))
    make_user("viewer", username="erin")
    cases = [
        ({"username": "Erin", "role": "viewer"}, "already exists"),
        ({"username": "a b", "role": "viewer"}, "&#x27;a b&#x27; is not a valid username"),
        ({"username": "frank", "role": "root"}, "Select a valid choice"),
        ({"username": "frank", "role": "viewer", "password": "frank"}, "too short"),
    ]
    for data, message in cases:
        response = admin.post("/users/", data)
        assert response.status_code == 400, data
        assert message in response.content.decode(), (data, message)
    assert not User.objects.filter(username="frank").exists()


def test_role_change_and_deactivation_are_audited_and_refused_for_oneself(make_user):
    admin_user = make_user("admin")
    admin = client_for(admin_user)
    viewer = make_user("viewer", username="gil")

    admin.post(f"/users/{viewer.pk}/role/", {"role": "operator"})
    assert user_role(User.objects.get(pk=viewer.pk)) == "operator"
    assert AuditEvent.objects.get(action="user.role").before["role"] == "viewer"

    response = admin.post(f"/users/{viewer.pk}/role/", {"role": "emperor"}, follow=True)
    assert "&#x27;emperor&#x27; is not a role" in response.content.decode()

    admin.post(f"/users/{viewer.pk}/deactivate/")
    assert not User.objects.get(pk=viewer.pk).is_active
    assert client_for(viewer).get("/").status_code == 302  # a deactivated account is logged out

    response = admin.post(f"/users/{admin_user.pk}/deactivate/", follow=True)
    assert "You cannot deactivate your own account" in response.content.decode()
    assert User.objects.get(pk=admin_user.pk).is_active

    root = User.objects.create_superuser("root", password="pw-12345678")
    response = admin.post(f"/users/{root.pk}/role/", {"role": "viewer"}, follow=True)
    assert "is a superuser" in response.content.decode()


def test_writes_need_post_and_the_admin_role(make_user):
    operator = client_for(make_user("operator"))
    target = make_user("viewer", username="hal")
    assert operator.post(f"/users/{target.pk}/deactivate/").status_code == 403
    assert User.objects.get(pk=target.pk).is_active
    assert client_for(make_user("admin")).get(f"/users/{target.pk}/deactivate/").status_code == 405


def test_the_audit_log_shows_a_readable_diff_filters_and_paginates(make_user):
    admin_user = make_user("admin")
    admin = client_for(admin_user)
    gil = make_user("viewer", username="gil")
    admin.post(f"/users/{gil.pk}/role/", {"role": "operator"})
    for n in range(55):
        AuditEvent.objects.create(actor_name="robot", action="alias.set", object_type="registry.alias",
                                  object_id=str(n), object_repr=f"chat@prod-{n}",
                                  before={"version": 1, "labels": ["a"]}, after={"version": 2, "labels": ["a"]})

    page = admin.get("/audit/", {"action": "user.role"}).content.decode()
    assert "<strong>role</strong>: " in page and "viewer</span> → <span class=\"after\">operator" in page
    assert "is_active" not in page  # unchanged fields are left out
    assert "1 change match" in page

    response = admin.get("/audit/", {"actor": "ROBOT", "object": "prod-1"})
    page = response.content.decode()
    assert response.context["page"].paginator.count == 11  # prod-1 and prod-10 to prod-19
    assert "chat@prod-12 " in page and "chat@prod-2 " not in page
    assert admin.get("/audit/", {"object": "42"}).context["page"].paginator.count == 1  # by id
    assert "<strong>version</strong>: " in page and "labels" not in page

    first = admin.get("/audit/", {"actor": "robot"}).content.decode()
    assert "55 changes match" in first and "page 1 of 2" in first
    second = admin.get("/audit/", {"actor": "robot", "page": 2}).content.decode()
    assert "actor=robot" in second and "page 2 of 2" in second
    assert admin.get("/audit/", {"object_type": "registry.alias"}).context["page"].paginator.count == 55


def test_changes_read_as_values_not_python():
    event = AuditEvent(before=None, after={"name": "chat", "enabled": True, "tags": ["a", "b"], "limits": {"rpm": 5},
                                           "note": ""})
    assert event.changes() == [("name", "—", "chat"), ("enabled", "—", "yes"), ("tags", "—", "a, b"),
                               ("limits", "—", '{"rpm": 5}')]  # the empty note is no change
    assert AuditEvent(before={"a": 1, "b": 2, "c": None}, after=None).changes() == [("a", "1", "—"), ("b", "2", "—")]
    # A field set and then cleared is a change; unicode reads as written, in JSON too.
    cleared = AuditEvent(before={"note": "x", "labels": {}}, after={"note": None, "labels": {"équipe": "東京"}})
    assert cleared.changes() == [("note", "x", "—"), ("labels", "—", '{"équipe": "東京"}')]
