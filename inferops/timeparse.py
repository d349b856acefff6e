"""One way to read a time and one way to read and write a duration, for every API, spec and page.

Both raise ValueError with a message that names the field, which the API layer answers as a 400
on that field (`inferops.api.query_time`, `query_step`).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")
DURATION_HINT = 'a duration like "90s", "5m", "1h30m" or "1d", or a number of seconds'


def parse_time(value: str, field: str) -> datetime:
    """An ISO 8601 time (naive means UTC) or Unix seconds, as an aware datetime."""
    try:
        if value.replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(value), tz=UTC)
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"{field}: {value!r} is not an ISO 8601 time or a Unix timestamp.") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_duration(value, field: str) -> float:
    """Seconds from "90s", "5m", "1h30m", "1d" or a number (of seconds)."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected {DURATION_HINT}, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        if text.replace(".", "", 1).isdigit():
            return float(text)
        if match := _DURATION.match(text):
            days, hours, minutes, seconds = match.groups()
            return int(days or 0) * 86400 + int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)
    raise ValueError(f"{field}: expected {DURATION_HINT}, got {value!r}")


_UNITS = (("d", 86400), ("h", 3600), ("m", 60))


def format_duration(seconds: float) -> str:
    """The inverse of parse_duration, for people: 1440 min reads "1d", 90 min "1h30m", 45.5 s
    "45.5s" (largest units first, zero units left out)."""
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {seconds!r}")
    parts = []
    rest = float(seconds)
    for name, size in _UNITS:
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{int(count)}{name}")
    if rest or not parts:
        parts.append(f"{rest:g}s")
    return "".join(parts)
