"""Admin pages whose writes go through the apps' services, and the audit log's (read-only).

A write in the admin is a write like any other: validated, audited and followed by what the
service does after it (API keys republished, an SLO re-evaluated). A page offers add, change or
delete only where its admin names the service for it; a service's refusal is shown on the page.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.http import HttpResponseRedirect
from rest_framework.authtoken.admin import TokenAdmin
from rest_framework.authtoken.models import TokenProxy

from inferops.api import Conflict
from inferops.audit import audit_record, snapshot
from inferops.login_limits import AdminLoginForm
from inferops.models import AuditEvent
from inferops.user_views import user_facts

# The admin's sign-in counts failures with the console's.
admin.site.login_form = AdminLoginForm


class ServiceAdmin(admin.ModelAdmin):
    """Subclasses define create_object(request, fields), update_object(request, obj, fields) and
    delete_object(request, obj) for the writes they allow; each calls one service."""

    create_object = update_object = delete_object = None
    readonly_after_create: tuple[str, ...] = ()  # what names the object: typed when it is made, fixed after

    def get_readonly_fields(self, request, obj=None):
        return [*super().get_readonly_fields(request, obj), *(self.readonly_after_create if obj else ())]

    def has_add_permission(self, request) -> bool:
        return self.create_object is not None and super().has_add_permission(request)

    def has_change_permission(self, request, obj=None) -> bool:
        return self.update_object is not None and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return self.delete_object is not None and super().has_delete_permission(request, obj)

    def save_model(self, request, obj, form, change) -> None:
        if change:
            saved = self.update_object(request, type(obj).objects.get(pk=obj.pk),
                                       {name: form.cleaned_data[name] for name in form.changed_data})
        else:
            saved = self.create_object(request, dict(form.cleaned_data))
        obj.pk = saved.pk  # the admin's messages and redirect name what was saved

    def save_related(self, request, form, formsets, change) -> None:
        pass  # the services write whole objects; admin pages here have no inlines

    def get_deleted_objects(self, objs, request):
        # The service decides what goes with the row (a deployment is marked deleted and keeps its rollouts):
        # the admin pages of the rows Django would cascade to, read-only here, do not forbid it.
        deleted, counts, _, protected = super().get_deleted_objects(objs, request)
        return deleted, counts, set(), protected

    def delete_model(self, request, obj) -> None:
        self.delete_object(request, obj)

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset:
            self.delete_object(request, obj)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except (ValidationError, Conflict) as exc:
            self.message_user(request, f"Not saved: {refusal(exc)}", level=messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())


def refusal(exc: ValidationError | Conflict) -> str:
    if isinstance(exc, Conflict):
        return str(exc.detail)
    if hasattr(exc, "error_dict"):
        return "; ".join(f"{field}: {' '.join(errors)}" for field, errors in exc.message_dict.items())
    return " ".join(exc.messages)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor_name", "action", "object_repr"]
    list_filter = ["action", "object_type"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class AuditedAdmin(admin.ModelAdmin):
    """Django's own pages (users, groups, API tokens), which have no service: each write they log in the
    admin's history is recorded in the audit log too, as `<audit_name>.create`, `.update` or `.delete`."""

    audit_name = ""

    def audited(self, obj):
        """The row the event names and what it keeps of it (never a password or a token)."""
        return obj, snapshot(obj)

    def audit(self, request, obj, verb: str) -> None:
        named, facts = self.audited(obj)
        audit_record(actor=request.user, action=f"{self.audit_name}.{verb}", obj=named,
                     before=facts if verb == "delete" else None, after=None if verb == "delete" else facts)

    def log_addition(self, request, obj, message):
        self.audit(request, obj, "create")
        return super().log_addition(request, obj, message)

    def log_change(self, request, obj, message):  # the password page's change too
        self.audit(request, obj, "update")
        return super().log_change(request, obj, message)

    def log_deletions(self, request, queryset):
        for obj in queryset:
            self.audit(request, obj, "delete")
        return super().log_deletions(request, queryset)


class AuditedUserAdmin(AuditedAdmin, UserAdmin):
    audit_name = "user"

    def audited(self, obj):
        obj.__dict__.pop("_inferops_role", None)  # its groups, the role, may have just changed
        return obj, user_facts(obj)


class AuditedGroupAdmin(AuditedAdmin, GroupAdmin):
    audit_name = "group"


class AuditedTokenAdmin(AuditedAdmin, TokenAdmin):
    audit_name = "token"

    def audited(self, obj):
        return obj.user, {"user": obj.user.username}  # a token's string is its key


for model, model_admin in ((User, AuditedUserAdmin), (Group, AuditedGroupAdmin), (TokenProxy, AuditedTokenAdmin)):
    admin.site.unregister(model)
    admin.site.register(model, model_admin)
