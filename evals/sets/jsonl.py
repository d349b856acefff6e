"""Reading an eval set's JSONL upload into the cases a version stores, or every bad line with what to do.

One JSON object a line (blank lines skipped). A case is `id`, `prompt` or `messages`, an optional
`scorer` (the set's otherwise), `max_tokens`, and what its scorer needs:
- `exact` / `regex`: `expected` (a regex must compile);
- `choice`: `choices` (two or more continuations) and `answer` (the right one's index);
- `similarity`: `reference`, and `threshold` in (0, 1] (0.8 by default);
- `parity`: nothing: the output is compared with a reference version's.
A file with any bad line is refused whole, so a version is never a silently shortened set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from evals.choices import Scorer

DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_RANGE = (1, 4096)
DEFAULT_THRESHOLD = 0.8
MAX_ID_CHARS = 200  # EvalCaseResult.case_id
CHAT_ROLES = ("system", "developer", "user", "assistant")  # what both engines' chat endpoints take

# What each scorer reads beside the keys every case has.
SCORER_KEYS = {
    Scorer.EXACT: ("expected",),
    Scorer.REGEX: ("expected",),
    Scorer.CHOICE: ("choices", "answer"),
    Scorer.SIMILARITY: ("reference", "threshold"),
    Scorer.PARITY: (),
}
COMMON_KEYS = ("id", "prompt", "messages", "scorer", "max_tokens")
KNOWN_KEYS = frozenset(COMMON_KEYS).union(*SCORER_KEYS.values())
SCORERS = ", ".join(Scorer.values)


class FileTooLarge(ValueError):
    """The upload is over INFEROPS_EVALSET_MAX_BYTES; nothing of it was read."""


class BadFile(ValueError):
    """The upload's bad lines: [{"line": n (1-based; None for the file as a whole), "error": "..."}]."""

    def __init__(self, errors: list[dict]):
        super().__init__(f"{len(errors)} problem(s) in the file")
        self.errors = errors


def too_large(max_bytes: int) -> FileTooLarge:
    return FileTooLarge(f"The file is over {max_bytes} bytes, the limit of one version "
                        "(INFEROPS_EVALSET_MAX_BYTES): split the set.")


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_cases: int


def parse_cases(raw: bytes, *, default_scorer: str, limits: Limits) -> list[dict]:
    """The file's cases, normalised (scorer and max_tokens always filled), in file order.

    Raises FileTooLarge over the byte limit, else BadFile naming every bad line at once."""
    if len(raw) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    cases, errors = [], []
    first_line_of: dict[str, int] = {}
    for number, line in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
        if not line.strip():
            continue
        if len(cases) == limits.max_cases:
            errors.append(_error(number, f"more than {limits.max_cases} cases, the limit of one version "
                                         "(INFEROPS_EVALSET_MAX_CASES): split the set"))
            break
        case, problems = _read_case(line, default_scorer)
        case_id = case.get("id") if case else None
        if isinstance(case_id, str) and case_id:
            if case_id in first_line_of:
                problems.append(f"duplicate id {case_id!r}: line {first_line_of[case_id]} already uses it; "
                                "give each case its own id")
            else:
                first_line_of[case_id] = number
        errors += [_error(number, problem) for problem in problems]
        if not problems:
            cases.append(case)
    if not cases and not errors:
        errors.append(_error(None, "the file holds no cases: write one JSON object per line"))
    if errors:
        raise BadFile(errors)
    return cases


def _error(line: int | None, text: str) -> dict:
    return {"line": line, "error": text[:1].upper() + text[1:] + "."}


def _read_case(line: bytes, default_scorer: str) -> tuple[dict | None, list[str]]:
    """(the case normalised, or the raw object when it has problems; [its problems])."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1}): "
                      "save the file as UTF-8"]
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"malformed JSON ({exc.msg} at column {exc.colno}): write one JSON object per line"]
    if not isinstance(raw, dict):
        return None, [f"a line must be a JSON object, not {_json_type(raw)}"]
    if _holds_nul(raw):
        # Postgres stores no NUL character in text or JSON.
        return None, ["holds a NUL character (\\u0000), which cannot be stored: remove it"]
    problems: list[str] = []
    case: dict = {}
    _check_id(raw, case, problems)
    _check_input(raw, case, problems)
    scorer = _check_scorer(raw, default_scorer, case, problems)
    _check_max_tokens(raw, case, problems)
    if scorer is not None:
        _check_keys(raw, scorer, problems)
        CHECKS[scorer](raw, case, problems)
    return (case if not problems else raw), problems


def _json_type(value) -> str:
    names = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")


def _holds_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_id(raw: dict, case: dict, problems: list[str]) -> None:
    case_id = raw.get("id")
    if "id" not in raw:
        problems.append("missing `id`: give each case a unique string id")
    elif not isinstance(case_id, str):
        problems.append(f"`id` must be a string, not {_json_type(case_id)} ({json.dumps(case_id)})")
    elif not case_id.strip():
        problems.append("`id` is empty: give each case a unique string id")
    elif len(case_id) > MAX_ID_CHARS:
        problems.append(f"`id` is {len(case_id)} characters; keep it to {MAX_ID_CHARS}")
    else:
        case["id"] = case_id


def _check_input(raw: dict, case: dict, problems: list[str]) -> None:
    has_prompt, has_messages = "prompt" in raw, "messages" in raw
    if has_prompt == has_messages:
        problems.append("has both `prompt` and `messages`: keep one" if has_prompt
                        else "needs `prompt` (a string) or `messages` (a list of {role, content})")
    elif has_prompt:
        if not isinstance(raw["prompt"], str) or not raw["prompt"]:
            problems.append("`prompt` must be a non-empty string")
        else:
            case["prompt"] = raw["prompt"]
    elif (problem := _messages_problem(raw["messages"])) is not None:
        problems.append(problem)
    else:
        case["messages"] = [{"role": m["role"], "content": m["content"]} for m in raw["messages"]]


def _messages_problem(messages) -> str | None:
    shape = "a non-empty list of {\"role\": ..., \"content\": \"...\"}"
    if not isinstance(messages, list) or not messages:
        return f"`messages` must be {shape}"
    for index, message in enumerate(messages):
        where = f"`messages[{index}]`"
        if not isinstance(message, dict):
            return f"{where} must be an object {{\"role\": ..., \"content\": \"...\"}}"
        if extra := sorted(set(message) - {"role", "content"}):
            return f"{where} has unknown keys {', '.join(extra)}: a message is only role and content"
        if message.get("role") not in CHAT_ROLES:
            return f"{where}.role must be one of {', '.join(CHAT_ROLES)}, not {json.dumps(message.get('role'))}"
        if not isinstance(message.get("content"), str):
            return f"{where}.content must be a string"
    return None


def _check_scorer(raw: dict, default_scorer: str, case: dict, problems: list[str]) -> str | None:
    scorer = raw.get("scorer", default_scorer)
    if scorer not in Scorer.values:
        where = "" if "scorer" in raw else " (the set's default)"
        problems.append(f"unknown scorer {json.dumps(scorer)}{where}: use one of {SCORERS}")
        return None
    case["scorer"] = scorer
    return scorer


def _check_max_tokens(raw: dict, case: dict, problems: list[str]) -> None:
    value = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    low, high = MAX_TOKENS_RANGE
    if not _is_int(value) or not low <= value <= high:
        problems.append(f"`max_tokens` must be a whole number from {low} to {high}, not {json.dumps(value)}")
    else:
        case["max_tokens"] = value


def _check_keys(raw: dict, scorer: str, problems: list[str]) -> None:
    if unknown := sorted(set(raw) - KNOWN_KEYS):
        problems.append(f"unknown keys {', '.join(unknown)}: a case takes {', '.join(sorted(KNOWN_KEYS))}")
    if foreign := sorted((set(raw) & KNOWN_KEYS) - set(COMMON_KEYS) - set(SCORER_KEYS[scorer])):
        problems.append(f"{', '.join(foreign)} not used by the {scorer} scorer: remove them or set this "
                        "case's `scorer`")


def _check_expected(raw: dict, case: dict, problems: list[str], *, regex: bool) -> None:
    expected = raw.get("expected")
    if not isinstance(expected, str) or not expected:
        what = "a regular expression" if regex else "the answer"
        problems.append(f"`expected` must be a non-empty string ({what})")
        return
    if regex:
        try:
            re.compile(expected)
        except re.error as exc:
            problems.append(f"`expected` is not a valid regular expression: {exc}")
            return
    case["expected"] = expected


def _check_exact(raw: dict, case: dict, problems: list[str]) -> None:
    _check_expected(raw, case, problems, regex=False)


def _check_regex(raw: dict, case: dict, problems: list[str]) -> None:
    _check_expected(raw, case, problems, regex=True)


def _check_choice(raw: dict, case: dict, problems: list[str]) -> None:
    choices, answer = raw.get("choices"), raw.get("answer")
    found = len(problems)
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        problems.append("`choices` must be a list of two or more non-empty strings")
        choices = None
    if "answer" not in raw:
        problems.append("missing `answer`: the index of the right choice, from 0")
    elif not _is_int(answer):
        problems.append(f"`answer` must be the index of the right choice (a whole number from 0), "
                        f"not {json.dumps(answer)}")
    elif choices is not None and not 0 <= answer < len(choices):
        problems.append(f"`answer` {answer} is out of range: {len(choices)} choices (index from 0 to "
                        f"{len(choices) - 1})")
    if len(problems) == found:
        case["choices"], case["answer"] = choices, answer


def _check_similarity(raw: dict, case: dict, problems: list[str]) -> None:
    reference, threshold = raw.get("reference"), raw.get("threshold", DEFAULT_THRESHOLD)
    if not isinstance(reference, str) or not reference:
        problems.append("`reference` must be a non-empty string (the text the output should mean)")
    else:
        case["reference"] = reference
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        problems.append(f"`threshold` must be a number above 0 and at most 1, not {json.dumps(threshold)}")
    else:
        case["threshold"] = float(threshold)


def _check_parity(raw: dict, case: dict, problems: list[str]) -> None:
    """Parity needs no expectation: the reference version's output is it."""


CHECKS = {
    Scorer.EXACT: _check_exact,
    Scorer.REGEX: _check_regex,
    Scorer.CHOICE: _check_choice,
    Scorer.SIMILARITY: _check_similarity,
    Scorer.PARITY: _check_parity,
}
