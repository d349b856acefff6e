"""Console pages of the routing tree and escalation policies: the tree as a person reads it (match
order, targets, effective grouping, open groups), forms to add, edit and delete routes, and the
escalation policies with their steps and a form of up to six step rows.

The forms only read what was typed (matchers one per line as in amtool, group_by comma separated);
every check is the API's serializer and then alerts.routing.services', so the console and
`/api/v1/routes/` refuse the same things with the same messages.
"""

from __future__ import annotations

import json
import re

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render

from alerts.choices import OPEN_STATUSES
from alerts.matchers import parse_lines
from alerts.models import AlertGroup, EscalationPolicy, Receiver, Route, Schedule
from alerts.routing import services as route_services
from alerts.routing.api import EscalationPolicySerializer, RouteSerializer
from alerts.routing.dispatch import GROUP_BY_ALL, Tree
from inferops.api import Conflict
from inferops.console import console_action, tell_and_return
from inferops.roles import OPERATOR, require_operator

STEP_ROWS = 6
TIMING_FIELDS = ("group_wait_s", "group_interval_s", "repeat_interval_s")
# The API's field names where they differ from the form's.
ROUTE_FORM_FIELDS = {"continue": "continue_matching", "continue_matching": "continue_matching"}
SERVICE_PREFIX = re.compile(r"^(matchers|steps)\[(\d+)\]: ")


# ---------------------------------------------------------------------------- reading and writing text


def matcher_text(matcher: dict) -> str:
    return f"{matcher['name']}{matcher.get('op', '=')}{json.dumps(matcher['value'])}"


def parse_route_matchers(text: str) -> list[dict]:
    """amtool's matcher lines (alerts/matchers.py) as route matchers [{"name", "value", "op"}];
    every bad line is named."""
    return [{"name": name, "value": value, "op": op} for name, op, value in parse_lines(text)]


def parse_group_by(text: str, *, default_route_: bool) -> list[str] | None:
    """Comma separated label names; empty inherits (or, on the default route, groups everything
    into one group: it has nothing to inherit from)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        return [] if default_route_ else None
    return names


def seconds_text(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def group_by_text(group_by: list[str]) -> str:
    if GROUP_BY_ALL in group_by:
        return "every label (...)"
    return ", ".join(group_by) if group_by else "nothing: one group"


def item_errors(errors) -> list[tuple[int | None, str]]:
    """A serializer field's errors as (item index or None, text): a nested list serializer answers
    {index: {field: [...]}} (or a list of such dicts), a plain field a list of texts."""
    if isinstance(errors, dict):
        items = [(int(index), detail) for index, detail in errors.items()]
    elif errors and isinstance(errors[0], dict):
        items = list(enumerate(errors))
    else:
        return [(None, str(text)) for text in errors]
    return [(index, f"{name}: {text}") for index, detail in items for name, texts in detail.items() for text in texts]


def add_errors(form: forms.Form, errors: dict, fields: dict[str, str]) -> None:
    """Errors keyed by API or service field onto the form's fields (non-field when unknown)."""
    for key, texts in errors.items():
        field = fields.get(key, key if key in form.fields else None)
        for index, text in item_errors(texts):
            form.add_error(field, text if index is None else f"Item {index + 1} {text}")


# ---------------------------------------------------------------------------- the tree


def target_text(tree: Tree, route: Route) -> dict:
    """What the route notifies: its own receiver or policy, its nearest ancestor's, or (a bare
    default route) every active receiver."""
    notifier = tree.notifier(route)
    if notifier.receiver_id:
        what = {"receiver": notifier.receiver, "text": f"receiver {notifier.receiver.name} "
                                                      f"({notifier.receiver.get_kind_display()})"}
    elif notifier.escalation_policy_id:
        what = {"policy": notifier.escalation_policy, "text": f"escalation policy {notifier.escalation_policy.name}"}
    else:
        what = {"text": "every active receiver"}
    return {**what, "inherited": notifier.pk != route.pk}


def route_rows(tree: Tree) -> list[dict]:
    """The routes in match order, depth first, each with what a person needs to read it."""
    open_groups = dict(AlertGroup.objects.filter(alerts__status__in=OPEN_STATUSES).values_list("route")
                       .annotate(n=Count("pk", distinct=True)))
    rows = []

    def visit(route: Route, depth: int) -> None:
        timing = tree.timing(route)
        grouping = [{"name": "group_by", "value": group_by_text(timing.group_by),
                     "inherited": route.group_by is None}]
        grouping += [{"name": name.removesuffix("_s"), "value": seconds_text(getattr(timing, name)),
                      "inherited": getattr(route, name) is None} for name in TIMING_FIELDS]
        rows.append({"route": route, "depth": depth, "indent": depth * 24,
                     "matchers": [matcher_text(m) for m in route.matchers], "target": target_text(tree, route),
                     "grouping": grouping, "open_groups": open_groups.get(route.pk, 0)})
        for child in tree.children[route.pk]:
            visit(child, depth + 1)

    visit(tree.routes[tree.root.pk], 0)
    return rows


def route_label(row: dict) -> str:
    route = row["route"]
    if route.is_default:
        return "default route"
    return f"{'— ' * row['depth']}route {route.pk}: {' '.join(row['matchers']) or 'every alert'}"


@login_required
def route_list(request):
    return render(request, "alerts/routes.html", {"rows": route_rows(Tree())})


class RouteForm(forms.Form):
    parent = forms.ChoiceField(help_text="the route this one is tried under")
    position = forms.IntegerField(initial=0, help_text="order among its siblings: lower is tried first")
    matchers = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 4, "cols": 60, "class": "mono", "spellcheck": "false"}),
        help_text='one per line: name=value, name!=value, name=~regex, name!~regex (a value may be quoted: '
                  'severity="page"); every line must hold; none: every alert')
    receiver = forms.ChoiceField(required=False, help_text="a receiver, or")
    escalation_policy = forms.ChoiceField(required=False, help_text="an escalation policy; neither: the parent's")
    group_by = forms.CharField(required=False, max_length=2000,
                               help_text="label names, comma separated; ... for every label; empty: inherit")
    group_wait_s = forms.IntegerField(required=False, label="Group wait (s)",
                                      help_text="before a new group's first notification; empty: inherit")
    group_interval_s = forms.IntegerField(required=False, label="Group interval (s)",
                                          help_text="between notifications of alerts joining a group; empty: inherit")
    repeat_interval_s = forms.IntegerField(required=False, label="Repeat interval (s)",
                                           help_text="before a still-firing group notifies again; empty: inherit")
    continue_matching = forms.BooleanField(required=False, label="Continue",
                                           help_text="later siblings may take a matching alert too")

    def __init__(self, *args, route: Route | None = None, tree: Tree, **kwargs):
        super().__init__(*args, **kwargs)
        self.route = route
        self.is_default = bool(route and route.is_default)
        self.fields["receiver"].choices = [("", "—")] + [
            (r.name, f"{r.name} ({r.get_kind_display()})") for r in Receiver.objects.order_by("name")]
        self.has_receivers = len(self.fields["receiver"].choices) > 1
        self.fields["escalation_policy"].choices = [("", "—")] + [
            (name, name) for name in EscalationPolicy.objects.values_list("name", flat=True)]
        if self.is_default:
            for name in ("parent", "position", "matchers", "continue_matching"):
                del self.fields[name]
            self.fields["group_by"].help_text = "label names, comma separated; ... for every label; empty: one group"
            for name in TIMING_FIELDS:
                self.fields[name].required = True
                self.fields[name].help_text = self.fields[name].help_text.removesuffix("; empty: inherit")
        else:
            self.fields["parent"].choices = [(str(row["route"].pk), route_label(row)) for row in route_rows(tree)
                                             if not route or row["route"].pk != route.pk]

    def clean_matchers(self) -> list[dict]:
        return parse_route_matchers(self.cleaned_data["matchers"])

    def clean_group_by(self) -> list[str] | None:
        return parse_group_by(self.cleaned_data["group_by"], default_route_=self.is_default)

    def api_body(self) -> dict:
        data = self.cleaned_data
        body = {"receiver": data["receiver"] or None, "escalation_policy": data["escalation_policy"] or None,
                "group_by": data["group_by"], **{name: data[name] for name in TIMING_FIELDS}}
        if not self.is_default:
            body.update(parent=int(data["parent"]), position=data["position"], matchers=data["matchers"],
                        **{"continue": data["continue_matching"]})
        return body


def route_initial(route: Route) -> dict:
    return {"parent": str(route.parent_id or ""), "position": route.position,
            "matchers": "\n".join(matcher_text(m) for m in route.matchers),
            "receiver": route.receiver.name if route.receiver_id else "",
            "escalation_policy": route.escalation_policy.name if route.escalation_policy_id else "",
            "group_by": ", ".join(route.group_by) if route.group_by is not None else "",
            **{name: getattr(route, name) for name in TIMING_FIELDS}, "continue_matching": route.continue_matching}


def next_position(parent: Route) -> int:
    positions = list(parent.children.values_list("position", flat=True))
    return max(positions) + 1 if positions else 0


def route_write(form: RouteForm, actor) -> Route | None:
    """The API's serializer, then the service; their errors go beside the form's fields."""
    serializer = RouteSerializer(form.route, data=form.api_body(), partial=form.route is not None)
    if not serializer.is_valid():
        add_errors(form, serializer.errors, ROUTE_FORM_FIELDS)
        return None
    try:
        return route_services.route_save(instance=form.route, fields=dict(serializer.validated_data), actor=actor)
    except ValidationError as exc:
        add_errors(form, exc.message_dict, ROUTE_FORM_FIELDS)
        return None


@login_required
def route_edit(request, pk: int | None = None):
    route = get_object_or_404(Route.objects.select_related("receiver", "escalation_policy"), pk=pk) if pk else None
    require_operator(request, "Editing a route" if route else "Adding a route")
    tree = Tree()
    if request.method == "POST":
        form = RouteForm(request.POST, route=route, tree=tree)
        if form.is_valid() and (saved := route_write(form, request.user)) is not None:
            messages.success(request, f"{'Default route' if saved.is_default else f'Route {saved.pk}'} saved.")
            return redirect("alerts:routes")
        return render(request, "alerts/route_form.html", {"form": form, "route": route}, status=400)
    if route:
        initial = route_initial(route)
    else:
        root = tree.routes[tree.root.pk]
        initial = {"parent": str(root.pk), "position": next_position(root)}
    if added := request.GET.get("receiver"):  # back from "add one": the receiver just made
        initial.update(receiver=added, escalation_policy="")
    return render(request, "alerts/route_form.html",
                  {"form": RouteForm(initial=initial, route=route, tree=tree), "route": route})


@console_action(OPERATOR, "Deleting a route")
def route_remove(request, pk: int):
    route = get_object_or_404(Route, pk=pk)
    return tell_and_return(request, lambda: route_services.route_delete(route=route, actor=request.user),
                           f"Route {pk} deleted, with the routes under it.", "alerts:routes")


# ---------------------------------------------------------------------------- escalation policies


def step_text(step) -> str:
    who = []
    if receivers := [r.name for r in step.receivers.all()]:
        who.append(f"receivers {', '.join(receivers)}")
    if users := [u.username for u in step.users.all()]:
        who.append(f"users {', '.join(users)}")
    if step.schedule:
        who.append(f"whoever is on call in schedule {step.schedule.name}")
    return f"after {step.after_minutes} min: notify {', '.join(who)}"


def policies():
    return EscalationPolicy.objects.prefetch_related("steps__receivers", "steps__users", "steps__schedule", "routes")


@login_required
def policy_list(request):
    rows = [{"policy": policy, "steps": [step_text(s) for s in policy.steps.all()],
             "routes": [{"route": r, "matchers": " ".join(matcher_text(m) for m in r.matchers) or "every alert"}
                        for r in sorted(policy.routes.all(), key=lambda r: r.pk)]} for policy in policies()]
    return render(request, "alerts/policies.html", {"rows": rows})


class PolicyForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="lowercase letters, digits and dashes")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}))


class StepForm(forms.Form):
    after_minutes = forms.IntegerField(required=False, widget=forms.NumberInput(attrs={"style": "width:6em"}))
    receivers = forms.MultipleChoiceField(required=False)
    users = forms.MultipleChoiceField(required=False)
    schedule = forms.ChoiceField(required=False)

    def __init__(self, *args, choices: dict, **kwargs):
        super().__init__(*args, **kwargs)
        for name, options in choices.items():
            self.fields[name].choices = options

    def is_blank(self) -> bool:
        data = self.cleaned_data
        return data.get("after_minutes") is None and not (data.get("receivers") or data.get("users")
                                                          or data.get("schedule"))

    def clean(self):
        data = super().clean()
        if data.get("after_minutes") is None and not self.is_blank():
            self.add_error("after_minutes", "After how many minutes? 0 for at once.")
        return data


def step_choices() -> dict:
    users = get_user_model().objects.filter(is_active=True).order_by("username").values_list("username", flat=True)
    receivers = Receiver.objects.order_by("name").values_list("name", flat=True)
    schedules = Schedule.objects.order_by("name").values_list("name", flat=True)
    return {"receivers": [(name, name) for name in receivers], "users": [(name, name) for name in users],
            "schedule": [("", "—")] + [(name, name) for name in schedules]}


def step_forms(data=None, initial: list[dict] | None = None) -> list[StepForm]:
    choices, initial = step_choices(), initial or []
    rows = max(STEP_ROWS, len(initial))  # a policy the API gave more steps keeps them all
    return [StepForm(data, prefix=f"step-{index}", choices=choices,
                     initial=initial[index] if index < len(initial) else None) for index in range(rows)]


def policy_step_initial(policy: EscalationPolicy) -> list[dict]:
    return [{"after_minutes": s.after_minutes, "receivers": [r.name for r in s.receivers.all()],
             "users": [u.username for u in s.users.all()], "schedule": s.schedule.name if s.schedule else ""}
            for s in policy.steps.all()]


def policy_write(form: PolicyForm, steps: list[StepForm], policy: EscalationPolicy | None, actor):
    """The API's serializer, then the service. Errors about step i name the row it came from;
    they are returned (the form's own go beside its fields)."""
    kept = [(number, step) for number, step in enumerate(steps, start=1) if not step.is_blank()]
    body = {**form.cleaned_data, "steps": [{**step.cleaned_data, "schedule": step.cleaned_data["schedule"] or None}
                                           for _, step in kept]}
    row_of = {str(index): number for index, (number, _) in enumerate(kept)}

    def in_rows(texts: list[str]) -> list[str]:
        return [SERVICE_PREFIX.sub(lambda m: f"Step row {row_of.get(m.group(2), m.group(2))}: ", str(t))
                for t in texts]

    serializer = EscalationPolicySerializer(policy, data=body)
    if not serializer.is_valid():
        errors = dict(serializer.errors)
        step_errors = errors.pop("steps", [])
        add_errors(form, errors, {})
        return None, [text if index is None else f"Step row {row_of[str(index)]}: {text}"
                      for index, text in item_errors(step_errors)]
    fields = dict(serializer.validated_data)
    try:
        return route_services.policy_save(instance=policy, fields=fields, steps=fields.pop("steps"),
                                          actor=actor), []
    except ValidationError as exc:
        errors = exc.message_dict
        add_errors(form, {k: v for k, v in errors.items() if k != "steps"}, {})
        return None, in_rows(errors.get("steps", []))
    except Conflict as exc:
        form.add_error("name", str(exc.detail))
        return None, []


@login_required
def policy_edit(request, name: str | None = None):
    policy = get_object_or_404(policies(), name=name) if name else None
    require_operator(request, "Editing an escalation policy" if policy else "Creating an escalation policy")
    if request.method == "POST":
        form, steps = PolicyForm(request.POST), step_forms(request.POST)
        step_errors: list[str] = []
        if all([form.is_valid(), *[step.is_valid() for step in steps]]):
            saved, step_errors = policy_write(form, steps, policy, request.user)
            if saved is not None:
                messages.success(request, f"Escalation policy {saved.name} saved.")
                return redirect("alerts:policies")
        return render(request, "alerts/policy_form.html",
                      {"form": form, "steps": steps, "step_errors": step_errors, "policy": policy}, status=400)
    if policy:
        form = PolicyForm(initial={"name": policy.name, "description": policy.description})
        steps = step_forms(initial=policy_step_initial(policy))
    else:
        form, steps = PolicyForm(), step_forms(initial=[{"after_minutes": 0}])
    return render(request, "alerts/policy_form.html", {"form": form, "steps": steps, "policy": policy})


@console_action(OPERATOR, "Deleting an escalation policy")
def policy_remove(request, name: str):
    policy = get_object_or_404(EscalationPolicy, name=name)
    return tell_and_return(request, lambda: route_services.policy_delete(policy=policy, actor=request.user),
                           f"Escalation policy {name} deleted.", "alerts:policies")

