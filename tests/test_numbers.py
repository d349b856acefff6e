"""inferops.numbers: thousands separators and dollars, as the cost pages and the PDF show them."""

from __future__ import annotations

from decimal import Decimal

import pytest

from inferops.numbers import grouped, usd


@pytest.mark.parametrize(("value", "text"), [
    (1234567, "1,234,567"), (0, "0"), ("12345.60", "12,345.60"), (Decimal("1234.5678"), "1,234.5678"),
    ("-1234567.00", "-1,234,567.00"), ("0.0001", "0.0001"), (None, ""), ("", ""), ("n/a", "n/a")])
def test_grouped_keeps_the_decimals_given(value, text):
    assert grouped(value) == text


@pytest.mark.parametrize(("value", "text"), [("1234.50", "$1,234.50"), ("-3.10", "-$3.10"), (None, "—")])
def test_usd_puts_the_sign_before_the_symbol(value, text):
    assert usd(value) == text
