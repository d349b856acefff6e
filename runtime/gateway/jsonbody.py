"""A request body read as JSON, by the gateway and the replica alike: whatever Python's json
module accepts beyond JSON, or fails on with an error other than ValueError, is a malformed
body (a 400), never a 500.

- NaN and Infinity are not JSON, yet json.loads reads them (and 1e400 as infinity); a NaN
  temperature stopped the engine loop.
- Past about 1,000 levels json.loads raises RecursionError, and code that walks a parsed body
  recursively fails below that: nesting is capped at MAX_DEPTH, far above any OpenAI request.
- An unpaired surrogate (`"\\ud800"`) is valid JSON syntax but no text: tokenizers and UTF-8
  encoders refuse it.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64


class MalformedBody(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise MalformedBody(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a proxy writing it back out would write Infinity
        raise MalformedBody(f"{text[:40]} is beyond the range of a number")
    return value


def loads(body: bytes) -> Any:
    """The body's JSON value; MalformedBody (a ValueError) says what is wrong with it."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise MalformedBody(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # syntax, invalid UTF-8, an integer of over 4,300 digits
        raise MalformedBody(str(exc)) from None
    _check(value)
    return value


def _check(value: Any) -> None:
    """Depth and text, without recursion (a body nested just below json's limit must not fail here)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, (list, dict)):
            continue
        if depth >= MAX_DEPTH:
            raise MalformedBody(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            for key in item:
                _check_text(key)
            item = item.values()
        stack.extend((child, depth + 1) for child in item if isinstance(child, (str, list, dict)))


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedBody("a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), which is no "
                            "character") from None
