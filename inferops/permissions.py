from rest_framework.permissions import SAFE_METHODS, BasePermission

from inferops.roles import OPERATOR, VIEWER, has_role


class RolePermission(BasePermission):
    """Reads need `read_role` (viewer by default), writes `write_role` (operator by default).

    Anonymous requests fail authentication (401) before the role is checked (403).
    """

    message = "Your role does not allow this action."

    def has_permission(self, request, view) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        if request.method in SAFE_METHODS:
            needed = getattr(view, "read_role", VIEWER)
        else:
            needed = getattr(view, "write_role", OPERATOR)
        if not has_role(request.user, needed):
            self.message = f"This action needs the {needed} role."
            return False
        return True
