"""The three roles, as Django groups: viewer < operator < admin.

A user's role is the highest group they belong to; superusers are admins. Views name the least
role a request needs, and one comparison decides.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

VIEWER = "viewer"
OPERATOR = "operator"
ADMIN = "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
RANK = {None: 0, VIEWER: 1, OPERATOR: 2, ADMIN: 3}


def user_role(user) -> str | None:
    if not user or not user.is_authenticated:
        return None
    if user.is_superuser:
        return ADMIN
    # Cached on the user object: one query per request, not per check.
    if not hasattr(user, "_inferops_role"):
        names = set(user.groups.values_list("name", flat=True))
        user._inferops_role = next((r for r in reversed(ROLES) if r in names), None)
    return user._inferops_role


def has_role(user, needed: str) -> bool:
    return RANK[user_role(user)] >= RANK[needed]


def require_role(request, needed: str, to: str) -> None:
    """PermissionDenied ("<to> needs the <needed> role.") unless the request's user has the role."""
    if not has_role(request.user, needed):
        raise PermissionDenied(f"{to} needs the {needed} role.")


def require_operator(request, to: str) -> None:
    require_role(request, OPERATOR, to)
