from inferops.roles import ADMIN, OPERATOR, has_role, user_role


def roles(request):
    user = getattr(request, "user", None)
    return {
        "user_role": user_role(user),
        "can_operate": has_role(user, OPERATOR),
        "is_admin_role": has_role(user, ADMIN),
    }


def csp_nonce(request):
    """The nonce inline scripts carry under the Content-Security-Policy (inferops.middleware)."""
    return {"csp_nonce": getattr(request, "csp_nonce", "")}
