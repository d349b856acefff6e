"""The one duration formatter the pages use: what parse_duration reads, written back for people."""

from __future__ import annotations

import pytest

from inferops.timeparse import format_duration, parse_duration


@pytest.mark.parametrize(("seconds", "text"), [
    (1440 * 60, "1d"), (120 * 60, "2h"), (4320 * 60, "3d"), (90 * 60, "1h30m"), (5 * 60, "5m"),
    (60, "1m"), (90, "1m30s"), (45.5, "45.5s"), (0, "0s"), (3 * 86400 + 7, "3d7s"), (86400 + 3600 + 60 + 1, "1d1h1m1s"),
])
def test_largest_units_first_and_zero_units_left_out(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text, "d") == seconds  # the two agree both ways


def test_a_negative_duration_is_refused():
    with pytest.raises(ValueError, match="negative"):
        format_duration(-1)
