"""The rollout form of the deployment page, and the undo it offers."""

import json
from dataclasses import dataclass

from django import forms
from django.core.exceptions import ValidationError

from deployments.choices import Strategy
from deployments.forms import JSONObjectField
from deployments.models import Rollout
from deployments.rollouts import services as rollouts
from deployments.rollouts.spec import DEFAULT_CANARY_STEPS


class OptionalJSONObjectField(JSONObjectField):
    """Empty means "not given" (None), unlike {}."""

    def to_python(self, value):
        return super().to_python(value) if (value or "").strip() else None


class JSONValueField(forms.CharField):
    """Any JSON value (the service says what shape it wants); empty is None."""

    widget = forms.Textarea(attrs={"rows": 4, "cols": 60, "class": "mono"})

    def to_python(self, value):
        value = (value or "").strip()
        if not value:
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg}.") from None

    def prepare_value(self, value):
        return value if isinstance(value, str) or value is None else json.dumps(value)


class RolloutForm(forms.Form):
    version = forms.TypedChoiceField(coerce=int, empty_value=None, required=False, label="Candidate version")
    engine_args = OptionalJSONObjectField(required=False, label="Candidate engine arguments",
                                          help_text="the whole set; empty = keep the current ones")
    strategy = forms.ChoiceField(choices=Strategy.choices, initial=Strategy.CANARY)
    steps = JSONValueField(required=False, initial=DEFAULT_CANARY_STEPS,
                           help_text='canary: set_weight / pause ("60s", {} = until promoted) / analysis ("2m") / '
                                     'quality ({"eval_set": "tiny-facts", "max_drop": 0.05, "min_score": 0.8})')
    scale_down_delay = forms.CharField(required=False, max_length=32, help_text='blue-green: e.g. "10m"')
    quality = JSONValueField(required=False, label="Quality gate",
                             help_text='blue-green: scored on the preview route before the switch, e.g. '
                                       '{"eval_set": "tiny-facts", "max_drop": 0.05}')
    override_reason = forms.CharField(required=False, max_length=500, label="Budget override reason",
                                      help_text="only while an SLO's error budget is exhausted; audited")
    holdback = forms.IntegerField(required=False, min_value=0, max_value=50, label="Holdback during the watch (%)",
                                  help_text="traffic kept on the current version after success, to compare with; "
                                            "empty = the default, 0 = none")

    def __init__(self, deployment, *args, **kwargs):
        super().__init__(*args, **kwargs)
        aliases: dict[int, list[str]] = {}
        for alias in deployment.model.aliases.all():
            aliases.setdefault(alias.version_id, []).append(alias.name)
        choices = [("", f"v{deployment.version.number} (keep the current version)")]
        for version in deployment.model.versions.order_by("-number"):
            label = f"v{version.number}"
            if version.id in aliases:
                label += f" ({', '.join(sorted(aliases[version.id]))})"
            if version.status != "ready":
                label += f" · {version.status}"
            choices.append((version.number, label))
        self.fields["version"].choices = choices
        self.fields["engine_args"].initial = deployment.engine_args

    def service_kwargs(self) -> dict:
        data = self.cleaned_data
        kwargs = {"version": data["version"], "engine_args": data["engine_args"], "strategy": data["strategy"],
                  "override_reason": data["override_reason"].strip(), "holdback": data["holdback"]}
        if data["strategy"] == Strategy.BLUE_GREEN:  # each strategy reads its own fields
            kwargs["scale_down_delay"] = data["scale_down_delay"].strip() or None
            kwargs["quality"] = data["quality"]
        else:
            kwargs["steps"] = data["steps"]
        return kwargs


@dataclass(frozen=True)
class UndoOffer:
    """What the Undo button would do (see rollouts.rollout_undo): its words, and the rollout whose version
    the platform rejected when undo would bring that version back (the form then asks why)."""

    text: str
    rejected: Rollout | None = None


def undo_offer(deployment, active) -> UndoOffer | None:
    if active is not None:
        return UndoOffer(f"abort rollout {active.pk}")
    last = rollouts.undo_target(deployment)
    if last is None:
        return None
    rejected = rollouts.rejected_by_platform(last)
    if rejected is not None:
        return UndoOffer(f"redeploy v{rejected.candidate_version.number}, which the platform rolled back", rejected)
    return UndoOffer(f"roll back to v{last.stable_version.number}" + (
        " with its engine args" if last.stable_engine_args != last.candidate_engine_args else ""))
