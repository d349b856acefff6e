"""Label matchers as Alertmanager writes them, for routes and silences alike: one per line as
amtool takes them (`name=value`, `name!=value`, `name=~regex`, `name!~regex`, a value may be
double-quoted: `severity="page"`), and the checks every matcher passes, typed in the console or
posted to the API.

A mistyped operator is refused, never read into the value: `deployment==demo` would otherwise be
stored as `deployment="=demo"`, a matcher that never matches, so no value may begin with = ! or ~
(Alertmanager's parser refuses these characters in an unquoted value too). Unlike Alertmanager's,
an unquoted value may hold spaces, since a line holds one matcher.
"""

from __future__ import annotations

import json
import re

from django.core.exceptions import ValidationError

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Each operator as Alertmanager API v2's flags: (isRegex, isEqual).
OPERATORS = {"=": (False, True), "!=": (False, False), "=~": (True, True), "!~": (True, False)}
REGEX_OPERATORS = ("=~", "!~")
OPERATOR_CHARACTERS = "=!~"
MAX_VALUE = 1000
SYNTAX = "name=value, name!=value, name=~regex or name!~regex"
# A name (bare, or double-quoted as Alertmanager allows), the operator, the rest of the line.
LINE = re.compile(r'\s*(?P<name>"(?:[^"\\]|\\.)*"|[^=!~"\s]*)\s*(?P<op>=~|!~|!=|=)(?P<value>.*)', re.DOTALL)


def matcher_problem(name, op: str, value) -> tuple[str, str] | None:
    """What is wrong with one matcher, as (field, message), or None: a name that is not a label
    name, a value that begins with an operator's character, a regex that does not compile."""
    if not isinstance(name, str) or not name:
        return "name", "Empty label name."
    if not LABEL_NAME.fullmatch(name):
        return "name", f"{name!r} is not a label name: letters, digits and underscores, not starting with a digit."
    if not isinstance(value, str) or len(value) > MAX_VALUE:
        return "value", f"The value must be a string of at most {MAX_VALUE} characters."
    if value[:1] and value[0] in OPERATOR_CHARACTERS:
        return "value", (f"{value!r} begins with {value[0]!r}: a mistyped operator ({name}{op}{value[0]})? "
                         f"The operators are = != =~ !~, and no value may begin with = ! or ~.")
    if op in REGEX_OPERATORS:
        try:
            re.compile(value)
        except re.error as exc:
            return "value", f"{value!r} is not a valid regular expression for {op}: {exc}."
    return None


def _unquote(text: str) -> str:
    if not text.startswith('"'):
        return text
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        raise ValueError(f"the quoted text {text!r} is not closed or has a bad escape") from None
    if end != len(text):
        raise ValueError(f"text after the closing quote: {text[end:]!r} (one matcher per line)")
    return value


def parse_line(line: str) -> tuple[str, str, str]:
    """One matcher line as (name, operator, value); raises ValueError saying what is wrong."""
    match = LINE.fullmatch(line)
    if not match:
        raise ValueError(f"{line.strip()!r} is not {SYNTAX}.")
    name, op, typed = match["name"], match["op"], match["value"].strip()
    if not typed:  # as Alertmanager: say "" to mean an empty (or missing) label
        raise ValueError(f"{line.strip()}: no value after {op} ({name}{op}\"\" matches an empty or missing label).")
    try:
        name, value = _unquote(name), _unquote(typed)
    except ValueError as exc:
        raise ValueError(f"{line.strip()}: {exc}.") from None
    if problem := matcher_problem(name, op, value):
        raise ValueError(f"{line.strip()}: {problem[1]}")
    return name, op, value


def parse_lines(text: str) -> list[tuple[str, str, str]]:
    """Matcher lines (blank lines skipped) as (name, operator, value); a ValidationError names
    every bad line by its number."""
    parsed, errors = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed.append(parse_line(line))
        except ValueError as exc:
            errors.append(f"Line {number}: {exc}")
    if errors:
        raise ValidationError(errors)
    return parsed
