"""Amounts and counts as people read them: `{% load amounts %}`."""

from __future__ import annotations

from django import template

from inferops import numbers

register = template.Library()


@register.filter
def grouped(value):
    """Thousands separators on a count or an amount: `{{ row.prompt_tokens|grouped }}`."""
    return numbers.grouped(value)


@register.filter
def usd(value):
    """Dollars with thousands separators: `{{ report.total_usd|usd }}` -> $1,234.50."""
    return numbers.usd(value)
