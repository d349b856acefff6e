"""First-run set-up: the admin user (and, as later issues land, the demo resources)."""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from inferops.roles import ADMIN


def ensure_admin(username: str = "admin") -> str | None:
    """Create the first admin when no admin exists; return its password (shown once) or None."""
    User = get_user_model()
    with transaction.atomic():
        if User.objects.filter(is_superuser=True).exists():
            return None
        password = secrets.token_urlsafe(12)
        user = User.objects.create_superuser(username=username, email="", password=password)
        user.groups.add(Group.objects.get(name=ADMIN))
    return password
