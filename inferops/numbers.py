"""Numbers as people read them: thousands separators, and dollars with the sign before the symbol."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation


def grouped(value) -> str:
    """An integer or a decimal (or its string) with thousands separators, its decimals kept as
    given: 1234567 -> "1,234,567", "12345.60" -> "12,345.60". None or "" -> ""; text passes through."""
    if value is None or value == "":
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    try:
        return format(Decimal(str(value)), ",")
    except InvalidOperation:
        return str(value)


def usd(value) -> str:
    """Dollars: "$1,234.50", "-$3.10"; None or "" -> "—"."""
    if value is None or value == "":
        return "—"
    text = grouped(value)
    return f"-${text[1:]}" if text.startswith("-") else f"${text}"
