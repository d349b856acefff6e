"""Console pages of users and their roles, for admins: list every account with its role, create one
(with a typed initial password, or a generated one shown once), change a role, deactivate.

Roles are the Django groups inferops.roles names; a user holds one of them. Each write owns its
transaction and records an audit event; the password, hashed or not, is never in it.
"""

from __future__ import annotations

import secrets

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.shortcuts import get_object_or_404, redirect, render

from inferops.api import Conflict
from inferops.audit import audit_record
from inferops.console import console_action, tell_and_return
from inferops.roles import ADMIN, ROLES, require_role, user_role

User = get_user_model()
ROLE_CHOICES = [(role, role) for role in ROLES]


def user_facts(user) -> dict:
    """What the audit log keeps of an account."""
    return {"username": user.username, "email": user.email, "role": user_role(user), "is_active": user.is_active}


def _set_group(user, role: str) -> None:
    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    user.groups.add(Group.objects.get(name=role))
    user.__dict__.pop("_inferops_role", None)  # user_role caches the role on the object


def user_create(*, username: str, email: str, role: str, password: str, actor):
    with transaction.atomic():
        if User.objects.filter(username__iexact=username).exists():
            raise Conflict(f"A user named {username!r} already exists.")
        try:
            with transaction.atomic():
                user = User.objects.create_user(username=username, email=email, password=password)
        except IntegrityError:
            raise Conflict(f"A user named {username!r} already exists.") from None
        _set_group(user, role)
        audit_record(actor=actor, action="user.create", obj=user, after=user_facts(user))
    return user


def _refuse_own_or_superuser(user, actor, doing: str) -> None:
    if user.pk == getattr(actor, "pk", None):
        raise Conflict(f"You cannot {doing} your own account: another admin has to.")
    if user.is_superuser:
        raise Conflict(f"{user.username} is a superuser, an admin whatever their groups: {doing} them in the "
                       "Django admin (/admin/).")


def user_set_role(*, user, role: str, actor):
    _refuse_own_or_superuser(user, actor, "change the role of")
    with transaction.atomic():
        before = user_facts(user)
        _set_group(user, role)
        audit_record(actor=actor, action="user.role", obj=user, before=before, after=user_facts(user))
    return user


def user_deactivate(*, user, actor):
    """The account can no longer log in or use its API token; its history stays."""
    _refuse_own_or_superuser(user, actor, "deactivate")
    with transaction.atomic():
        before = user_facts(user)
        user.is_active = False
        user.save(update_fields=["is_active"])
        audit_record(actor=actor, action="user.deactivate", obj=user, before=before, after=user_facts(user))
    return user


class UserForm(forms.Form):
    username = forms.CharField(max_length=150, help_text="letters, digits and @ . + - _")
    email = forms.EmailField(required=False)
    role = forms.ChoiceField(choices=ROLE_CHOICES, initial="viewer",
                             help_text="viewer reads; operator changes deployments and rollouts; admin also users, "
                                       "receivers and the audit log")
    password = forms.CharField(required=False, label="Initial password",
                               widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
                               help_text="empty: one is generated and shown once")

    def clean_username(self) -> str:
        username = self.cleaned_data["username"].strip()
        try:
            UnicodeUsernameValidator()(username)
        except ValidationError:
            raise ValidationError(f"{username!r} is not a valid username: use letters, digits and @ . + - _ "
                                  "only.") from None
        return username

    def clean(self):
        data = super().clean()
        if data.get("password") and "username" in data:
            try:
                validate_password(data["password"], User(username=data["username"], email=data.get("email", "")))
            except ValidationError as exc:
                self.add_error("password", exc)
        return data


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=ROLE_CHOICES)


def render_users(request, *, form=None, created=None, status=200):
    users = User.objects.prefetch_related("groups").order_by("username")
    rows = [{"user": user, "role": user_role(user)} for user in users]
    return render(request, "users.html", {"rows": rows, "form": form or UserForm(), "created": created,
                                          "roles": ROLES}, status=status)


@login_required
def user_list(request):
    require_role(request, ADMIN, "Managing users")
    if request.method != "POST":
        return render_users(request)
    form = UserForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        password = data["password"] or secrets.token_urlsafe(12)
        try:
            user = user_create(username=data["username"], email=data["email"], role=data["role"],
                               password=password, actor=request.user)
        except Conflict as exc:
            form.add_error("username", str(exc.detail))
        else:
            created = {"user": user, "password": None if data["password"] else password}
            return render_users(request, created=created)
    return render_users(request, form=form, status=400)


@console_action(ADMIN, "Changing a role")
def user_role_change(request, pk: int):
    user = get_object_or_404(User, pk=pk)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"{request.POST.get('role', '')!r} is not a role: choose one of {', '.join(ROLES)}.")
        return redirect("users")
    role, before = form.cleaned_data["role"], user_role(user)
    return tell_and_return(request, lambda: user_set_role(user=user, role=role, actor=request.user),
                           f"{user.username} is now {role} (was {before or 'no role'}).", "users")


@console_action(ADMIN, "Deactivating a user")
def user_deactivate_view(request, pk: int):
    user = get_object_or_404(User, pk=pk)
    return tell_and_return(request, lambda: user_deactivate(user=user, actor=request.user),
                           f"{user.username} deactivated: they can no longer log in or use the API.", "users")
