"""Console pages of receivers: where notifications go (a webhook, PagerDuty, a Slack-compatible
webhook, email addresses). Admins only, like `/api/v1/receivers/`: a receiver's URL or key lets
alerts leave the platform.

The form shows every kind's fields and sends the API's serializer those of the chosen kind (the
others blank, as the API does when a kind changes), then alerts.services.receiver_save, so the
console refuses what the API refuses. PagerDuty's routing key is write-only: the page says
whether one is stored and keeps it when the field is left empty.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render

from alerts import services
from alerts.api import RECEIVER_BLANK, RECEIVER_FIELDS, ReceiverSerializer
from alerts.choices import IncidentPer, ReceiverKind
from alerts.models import Receiver
from alerts.receivers.kinds import PAGERDUTY_EVENTS_URL
from inferops.api import Conflict
from inferops.console import console_action, tell_and_return
from inferops.panels import safe_next
from inferops.roles import ADMIN, require_role

# What each kind needs, in the form's words (the API names its own fields).
NEEDS = {ReceiverKind.WEBHOOK: ("url", "A webhook receiver needs the URL to POST to."),
         ReceiverKind.SLACK: ("url", "A Slack receiver needs its incoming webhook URL."),
         ReceiverKind.PAGERDUTY: ("routing_key", "A PagerDuty receiver needs its integration key."),
         ReceiverKind.EMAIL: ("to", "An email receiver needs at least one address.")}


class ReceiverForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="lowercase letters, digits and dashes, e.g. team-pager")
    kind = forms.ChoiceField(choices=ReceiverKind.choices)
    url = forms.CharField(required=False, max_length=500, label="URL",
                          widget=forms.TextInput(attrs={"size": 60, "class": "mono"}),
                          help_text=f"webhook and Slack: where to POST; PagerDuty: empty for {PAGERDUTY_EVENTS_URL}")
    routing_key = forms.CharField(required=False, max_length=200, label="Integration key",
                                  widget=forms.PasswordInput(attrs={"size": 40, "autocomplete": "off"}),
                                  help_text="PagerDuty's routing key; write-only")
    to = forms.CharField(required=False, label="Addresses", widget=forms.Textarea(attrs={"rows": 3, "cols": 50}),
                         help_text="email: one address per line (or comma separated)")
    incident_per = forms.ChoiceField(choices=IncidentPer.choices, initial=IncidentPer.GROUP, label="Incidents",
                                     required=False,
                                     help_text="PagerDuty: one incident per notification group (Alertmanager's way: "
                                               "a burst of one problem pages once), or one per alert")
    send_resolved = forms.BooleanField(required=False, initial=True, label="Send resolved",
                                       help_text="also tell it when an alert resolves")
    active = forms.BooleanField(required=False, initial=True, help_text="an inactive receiver is sent nothing")

    def __init__(self, *args, receiver: Receiver | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.receiver = receiver
        if receiver is not None and receiver.routing_key:
            self.fields["routing_key"].help_text = (
                f"a key ending …{receiver.routing_key[-4:]} is stored; leave empty to keep it, type a new one to "
                "replace it")

    def clean_to(self) -> list[str]:
        addresses = [a.strip() for line in self.cleaned_data["to"].splitlines() for a in line.split(",") if a.strip()]
        bad = []
        for address in addresses:
            try:
                validate_email(address)
            except ValidationError:
                bad.append(address)
        if bad:
            raise ValidationError(f"Not an email address: {', '.join(bad)}.")
        return addresses

    def clean_incident_per(self) -> str:
        return self.cleaned_data["incident_per"] or IncidentPer.GROUP  # not sent: the default

    def clean(self):
        data = super().clean()
        kind = data.get("kind")
        if kind in NEEDS:
            field, text = NEEDS[kind]
            kept_key = field == "routing_key" and self.receiver is not None and self.receiver.routing_key
            if field in data and not data[field] and not kept_key:
                self.add_error(field, text)
        return data

    def api_body(self) -> dict:
        """The fields of the chosen kind (the others blank); an empty routing key keeps the stored one."""
        data, kind = self.cleaned_data, self.cleaned_data["kind"]
        body = {"name": data["name"].strip(), "kind": kind, "send_resolved": data["send_resolved"],
                "active": data["active"]}
        for field, blank in RECEIVER_BLANK.items():
            body[field] = data[field] if field in RECEIVER_FIELDS[kind] else blank
        if kind == ReceiverKind.PAGERDUTY and not data["routing_key"] and self.receiver is not None:
            del body["routing_key"]
        return body


def initial_of(receiver: Receiver) -> dict:
    return {"name": receiver.name, "kind": receiver.kind, "url": receiver.url, "to": "\n".join(receiver.to),
            "incident_per": receiver.incident_per, "send_resolved": receiver.send_resolved, "active": receiver.active}


def receiver_write(form: ReceiverForm, actor) -> Receiver | None:
    body = form.api_body()
    serializer = ReceiverSerializer(form.receiver, data=body, partial=form.receiver is not None)
    if not serializer.is_valid():
        for field, texts in serializer.errors.items():
            typed = body.get(field)
            if isinstance(texts, dict):  # a list field: {index: [texts]}, each about one item typed
                texts = [f"{typed[int(i)]}: {' '.join(map(str, t))}" for i, t in texts.items()]
            elif isinstance(typed, str) and typed and field != "routing_key":  # never echo a secret
                texts = [f"{typed}: {text}" for text in texts]
            for text in texts:
                form.add_error(field if field in form.fields else None, str(text))
        return None
    try:
        return services.receiver_save(instance=form.receiver, fields=dict(serializer.validated_data), actor=actor)
    except Conflict as exc:
        form.add_error("name", str(exc.detail))
    return None


@login_required
def receiver_list(request):
    require_role(request, ADMIN, "Managing receivers")
    receivers = Receiver.objects.annotate(route_count=Count("routes", distinct=True)).prefetch_related("routes")
    return render(request, "alerts/receivers.html", {"receivers": receivers})


def with_receiver(url: str, name: str) -> str:
    """The page that sent the admin here, told which receiver was just saved (a route form selects it)."""
    parts = urlsplit(url)
    query = [(key, value) for key, value in parse_qsl(parts.query) if key != "receiver"] + [("receiver", name)]
    return urlunsplit(parts._replace(query=urlencode(query)))


@login_required
def receiver_edit(request, pk: int | None = None):
    """Add or edit a receiver; a local `next` (the route form's "add one") is where saving returns."""
    receiver = get_object_or_404(Receiver, pk=pk) if pk else None
    require_role(request, ADMIN, "Editing a receiver" if receiver else "Adding a receiver")
    back = safe_next(request)
    context = {"receiver": receiver, "next": back}
    if request.method == "POST":
        form = ReceiverForm(request.POST, receiver=receiver)
        if form.is_valid() and (saved := receiver_write(form, request.user)) is not None:
            messages.success(request, f"Receiver {saved.name} ({saved.get_kind_display()}) saved.")
            return redirect(with_receiver(back, saved.name) if back else "alerts:receivers")
        return render(request, "alerts/receiver_form.html", {**context, "form": form}, status=400)
    form = ReceiverForm(initial=initial_of(receiver) if receiver else None, receiver=receiver)
    return render(request, "alerts/receiver_form.html", {**context, "form": form})


@console_action(ADMIN, "Deleting a receiver")
def receiver_remove(request, pk: int):
    receiver = get_object_or_404(Receiver, pk=pk)
    return tell_and_return(request, lambda: services.receiver_delete(receiver=receiver, actor=request.user),
                           f"Receiver {receiver.name} deleted.", "alerts:receivers")
