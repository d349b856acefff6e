"""A batch input file's lines, checked before any token is spent (the `validating` state).

Every line is read and every problem is kept, so the error file names each bad line, not just the
first. A line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`;
all lines name one model (OpenAI's rule: one model per batch), a deployment of the right task that
the batch's key may use; `custom_id`s are unique, so a line's results are found by it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_CUSTOM_ID = 512
# Shown in the batch object's `errors`; the error file has every one.
MAX_ERRORS_SHOWN = 100


@dataclass(frozen=True)
class LineError:
    line: int  # 1-based, as editors and OpenAI count
    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def as_openai(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}

    def as_error_line(self) -> dict:
        return {"line": self.line, "custom_id": self.custom_id,
                "error": {"code": self.code, "message": self.message, "param": self.param}}


@dataclass
class Checked:
    """What validation found: the lines' count and model, or the errors."""

    lines: int = 0
    model: str | None = None
    errors: list[LineError] = field(default_factory=list)


def parse_line(raw: bytes) -> dict:
    """One input line as the runner reads it again (validation has passed)."""
    return json.loads(raw)


def check_lines(raw_lines: Iterable[bytes], endpoint: str, *, max_lines: int,
                model_problem: Callable[[str], tuple[str, str] | None]) -> Checked:
    """Check every line. `model_problem(name)` says why a model cannot be used, as (code, message), or None."""
    checked = Checked()
    seen: dict[str, int] = {}
    models: dict[str, tuple[str, str] | None] = {}
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, say) are not requests
        checked.lines += 1
        if checked.lines > max_lines:
            checked.errors.append(LineError(number, "too_many_requests",
                                            f"The file has more than {max_lines} requests; split it into batches "
                                            f"of at most {max_lines}."))
            break
        error = _check_line(number, raw, endpoint, seen)
        if isinstance(error, LineError):
            checked.errors.append(error)
            continue
        custom_id, model = error
        if checked.model is None:
            checked.model = model
        elif model != checked.model:
            checked.errors.append(LineError(number, "mismatched_model",
                                            f"Line {number} uses model `{model}`, but the batch's first request uses "
                                            f"`{checked.model}`: a batch runs one model; split the file.",
                                            "body.model", custom_id))
            continue
        if model not in models:
            models[model] = model_problem(model)
        if models[model] is not None:
            code, message = models[model]
            checked.errors.append(LineError(number, code, message, "body.model", custom_id))
    if not checked.lines and not checked.errors:
        checked.errors.append(LineError(1, "empty_file", "The input file has no requests."))
    return checked


def _check_line(number: int, raw: bytes, endpoint: str, seen: dict[str, int]) -> LineError | tuple[str, str]:
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return LineError(number, "invalid_json_line", f"Line {number} is not valid JSON: {exc}.")
    if not isinstance(line, dict):
        return LineError(number, "invalid_request", f"Line {number} must be a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return LineError(number, "invalid_request",
                         f"Line {number}: `custom_id` must be a string of 1-{MAX_CUSTOM_ID} characters.", "custom_id")
    if custom_id in seen:
        return LineError(number, "duplicate_custom_id",
                         f"Line {number} repeats the custom_id {custom_id!r} of line {seen[custom_id]}; each request "
                         "needs its own.", "custom_id", custom_id)
    seen[custom_id] = number
    if line.get("method") != "POST":
        return LineError(number, "invalid_method", f"Line {number}: `method` must be \"POST\".", "method", custom_id)
    if line.get("url") != endpoint:
        return LineError(number, "invalid_url",
                         f"Line {number}: `url` is {line.get('url')!r}, but this batch's endpoint is {endpoint!r}; "
                         "every request of a batch goes to its endpoint.", "url", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        return LineError(number, "invalid_request", f"Line {number}: `body` must be a JSON object.", "body", custom_id)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return LineError(number, "missing_model", f"Line {number}: `body.model` (a deployment name) is required.",
                         "body.model", custom_id)
    if body.get("stream") is True:
        return LineError(number, "invalid_request", f"Line {number}: a batch request cannot stream; drop `stream`.",
                         "body.stream", custom_id)
    return custom_id, model
