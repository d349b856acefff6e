"""Filters the console's templates share: `{% load console %}`."""

from __future__ import annotations

from datetime import UTC

from django import template
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from inferops import numbers
from inferops.assets import plotly_bundle
from inferops.models import readable

register = template.Library()


@register.filter
def keyvalues(values, empty: str = "—"):
    """A mapping (engine arguments, resources, a snapshot) as a key/value list, not a Python dict."""
    if not values:
        return format_html('<span class="muted">{}</span>', empty)
    if not isinstance(values, dict):
        return readable(values)
    items = format_html_join("", '<span class="kv"><span class="k">{}</span> {}</span>',
                             ((key, readable(value)) for key, value in sorted(values.items())))
    return format_html('<span class="kvs">{}</span>', items)


@register.filter
def utc(moment, precision: str = "minutes"):
    """The console's one way to show a time: UTC in the text, the reader's local time on hover
    (base.html's script fills the title from `datetime`). precision: "minutes" or "seconds"."""
    if not moment:
        return "—"
    moment = moment.astimezone(UTC)
    text = moment.strftime("%Y-%m-%d %H:%M:%S" if precision == "seconds" else "%Y-%m-%d %H:%M")
    return format_html('<time datetime="{}">{} UTC</time>', moment.isoformat(), text)


@register.simple_tag
def plotly_src() -> str:
    """The URL of the console's plotly.js, which names the bundle's digest (inferops.assets)."""
    return reverse("plotly-js", args=[plotly_bundle().digest])


@register.filter
def grouped(value):
    """Thousands separators on a count or an amount: `{{ row.prompt_tokens|grouped }}`."""
    return numbers.grouped(value)


@register.filter
def usd(value):
    """Dollars with thousands separators: `{{ report.total_usd|usd }}` -> $1,234.50."""
    return numbers.usd(value)
