"""Console forms of eval sets: a new set, and a version's JSONL upload."""

from __future__ import annotations

from django import forms

from evals.choices import Scorer
from inferops.validators import slug_validator
from registry.models import RegisteredModel


class EvalSetForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[slug_validator], help_text="lowercase letters, digits, hyphens")
    scorer = forms.ChoiceField(choices=Scorer.choices, label="Default scorer",
                               help_text="for the cases that name no scorer of their own")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}))
    default_for = forms.ModelMultipleChoiceField(
        queryset=RegisteredModel.objects.order_by("name"), to_field_name="name", required=False,
        label="Score new versions of", help_text="each new version of these models is scored on this set by itself")


class UploadForm(forms.Form):
    file = forms.FileField(label="JSONL file", help_text="one case per line: id, prompt or messages, and what "
                                                         "its scorer needs",
                           widget=forms.ClearableFileInput(attrs={"accept": ".jsonl,.ndjson,application/x-ndjson"}))
