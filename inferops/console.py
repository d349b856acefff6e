"""Console view helpers shared by every app's pages: the guard of a POST-only action and the
message that tells the user how the action went."""

from __future__ import annotations

from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from inferops.api import Conflict
from inferops.roles import require_role


def console_action(role: str, doing: str):
    """A button's POST target: logged in, POST only, and at least `role` ("<doing> needs the <role> role.")."""
    def decorate(view):
        @login_required
        @require_POST
        @wraps(view)
        def guarded(request, *args, **kwargs):
            require_role(request, role, doing)
            return view(request, *args, **kwargs)
        return guarded
    return decorate


def tell_outcome(request, call, done) -> bool:
    """Run a service call and say how it went: `done` when it worked, the service's reason when it
    refused (a Conflict). True when it worked."""
    try:
        call()
    except Conflict as exc:
        messages.error(request, str(exc.detail))
        return False
    messages.success(request, done)
    return True


def tell_and_return(request, call, done, to: str):
    """tell_outcome, then back to the page named `to` either way."""
    tell_outcome(request, call, done)
    return redirect(to)
