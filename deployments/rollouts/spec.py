"""Parsing a rollout request's strategy into normalised steps, with one error per bad field.

Durations are "90s", "2m", "1h30m" or a number of seconds. A canary is a list of steps:
`{"set_weight": 20}`, `{"pause": "60s"}` (or `{"pause": {}}`: until an operator promotes) and
`{"analysis": "2m"}` (or an object with `duration`, `min_requests`, `min_events`, `max_burn_rate`
and `thresholds`) and `{"quality": {"eval_set": "tiny-facts", "max_drop": 0.05, "min_score": 0.8}}`
(the candidate scored on an eval set through its preview route against the stable version; optional
`set_version` and `timeout`). After the last step the candidate takes all traffic. A blue-green
rollout is the same machinery with the candidate at full size from the start: an optional quality
step and an optional preview pause, then all traffic at once, then an optional analysis while the
old set stays warm for `scale_down_delay`.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError

from deployments.choices import Strategy
from inferops import timeparse

DEFAULT_CANARY_STEPS = [{"set_weight": 10}, {"analysis": "2m"}, {"set_weight": 50}, {"analysis": "2m"}]
DEFAULT_MIN_REQUESTS = 20
# A candidate burning its SLO's budget faster than this (1.0 = exactly the sustainable rate) fails.
DEFAULT_MAX_BURN_RATE = 2.0
# Candidate p95 / stable p95 limits an analysis may set; `error_rate_max` is absolute.
THRESHOLDS = ("ttft_p95_ratio", "tpot_p95_ratio", "e2e_p95_ratio", "error_rate_max")
ANALYSIS_KEYS = {"duration", "min_requests", "min_events", "max_burn_rate", "thresholds"}
# After success: how long the platform watches the new version for an automatic rollback.
DEFAULT_WATCH_S = 600.0
MAX_STEPS = 50
MAX_MIN_REQUESTS = 1_000_000
MAX_DURATION_S = 7 * 24 * 3600
QUALITY_KEYS = {"eval_set", "set_version", "max_drop", "min_score", "timeout"}
# How long a quality step waits for its eval runs before it aborts the rollout.
DEFAULT_QUALITY_TIMEOUT_S = 15 * 60.0


class StepErrors(ValueError):
    """Every bad field of one step, one message each."""

    def __init__(self, messages: list[str]):
        super().__init__("; ".join(messages))
        self.messages = messages


def parse_duration(value, field: str) -> float:
    """Seconds from "90s" / "2m" / "1h30m" / a number, at most 7 days; ValueError naming `field`."""
    seconds = timeparse.parse_duration(value, field)
    if not 0 <= seconds <= MAX_DURATION_S:
        raise ValueError(f"{field}: must lie between 0 and 7 days")
    return seconds


def _analysis(value, field: str) -> dict:
    if not isinstance(value, dict):
        value = {"duration": value}
    unknown = set(value) - ANALYSIS_KEYS
    if unknown:
        raise ValueError(f"{field}: unknown key(s) {', '.join(sorted(unknown))}; accepted: "
                         f"{', '.join(sorted(ANALYSIS_KEYS))}")
    if "duration" not in value:
        raise ValueError(f"{field}.duration: required (e.g. \"2m\")")
    duration = parse_duration(value["duration"], f"{field}.duration")
    if duration <= 0:
        raise ValueError(f"{field}.duration: must be longer than 0s")
    min_requests = value.get("min_requests", DEFAULT_MIN_REQUESTS)
    if type(min_requests) is not int or not 1 <= min_requests <= MAX_MIN_REQUESTS:
        raise ValueError(f"{field}.min_requests: expected an integer from 1 to {MAX_MIN_REQUESTS:,}")
    # Events a burn rate or threshold needs before it may fail the step; absent, each check derives
    # its own from its objective and limit (deployments.rollouts.gate.min_events).
    min_events = value.get("min_events")
    if min_events is not None and (type(min_events) is not int or not 1 <= min_events <= MAX_MIN_REQUESTS):
        raise ValueError(f"{field}.min_events: expected an integer from 1 to {MAX_MIN_REQUESTS:,}")
    max_burn = value.get("max_burn_rate", DEFAULT_MAX_BURN_RATE)
    if isinstance(max_burn, bool) or not isinstance(max_burn, int | float) or max_burn <= 0:
        raise ValueError(f"{field}.max_burn_rate: expected a number > 0")
    thresholds = value.get("thresholds", {})
    if not isinstance(thresholds, dict):
        raise ValueError(f"{field}.thresholds: expected an object, e.g. {{\"ttft_p95_ratio\": 1.2}}")
    for name, limit in thresholds.items():
        if name not in THRESHOLDS:
            raise ValueError(f"{field}.thresholds.{name}: unknown; accepted: {', '.join(THRESHOLDS)}")
        if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
            raise ValueError(f"{field}.thresholds.{name}: expected a number > 0")
    return {"duration": duration, "min_requests": min_requests, "max_burn_rate": float(max_burn),
            "thresholds": {name: float(limit) for name, limit in thresholds.items()},
            **({"min_events": min_events} if min_events is not None else {})}


def _fraction(value, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{field}: expected a number from 0 to 1")
    return float(value)


def _quality(value, field: str) -> dict:
    """A quality step's config, normalised: every key present (None when not given)."""
    if not isinstance(value, dict):
        raise ValueError(f"{field}: expected an object, e.g. {{\"eval_set\": \"tiny-facts\", \"max_drop\": 0.05}}")
    errors = []
    unknown = set(value) - QUALITY_KEYS
    if unknown:
        errors.append(f"{field}: unknown key(s) {', '.join(sorted(unknown))}; accepted: "
                      f"{', '.join(sorted(QUALITY_KEYS))}")
    eval_set = value.get("eval_set")
    if not isinstance(eval_set, str) or not eval_set.strip():
        errors.append(f"{field}.eval_set: required, the name of an eval set")
    set_version = value.get("set_version")
    if set_version is not None and (type(set_version) is not int or set_version < 1):
        errors.append(f"{field}.set_version: expected a version number (1 or more)")
    limits = {}
    for key in ("max_drop", "min_score"):
        try:
            limits[key] = _fraction(value.get(key), f"{field}.{key}")
        except ValueError as exc:
            errors.append(str(exc))
    if value.get("max_drop") is None and value.get("min_score") is None:
        errors.append(f"{field}: give max_drop (how far under the stable version's score the candidate may be), "
                      "min_score (a floor), or both")
    timeout = DEFAULT_QUALITY_TIMEOUT_S
    try:
        if value.get("timeout") is not None:
            timeout = parse_duration(value["timeout"], f"{field}.timeout")
            if timeout <= 0:
                raise ValueError(f"{field}.timeout: must be longer than 0s")
    except ValueError as exc:
        errors.append(str(exc))
    if errors:
        raise StepErrors(errors)
    return {"eval_set": eval_set.strip(), "set_version": set_version, **limits, "timeout": timeout}


def _step(step, field: str) -> dict:
    if not isinstance(step, dict) or len(step) != 1:
        raise ValueError(f"{field}: each step is an object with one key: set_weight, pause, analysis or quality")
    (kind, value), = step.items()
    if kind == "set_weight":
        if type(value) is not int or not 0 <= value <= 100:
            raise ValueError(f"{field}.set_weight: expected an integer percent 0-100")
        return {"set_weight": value}
    if kind == "pause":
        if value in ({}, None):
            return {"pause": None}
        if isinstance(value, dict):
            if set(value) != {"duration"}:
                raise ValueError(f"{field}.pause: give a duration (\"60s\") or {{}} to wait for promote")
            value = value["duration"]
        return {"pause": parse_duration(value, f"{field}.pause")}
    if kind == "analysis":
        return {"analysis": _analysis(value, f"{field}.analysis")}
    if kind == "quality":
        return {"quality": _quality(value, f"{field}.quality")}
    raise ValueError(f"{field}: unknown step {kind!r}; use set_weight, pause, analysis or quality")


def _messages(exc: ValueError) -> list[str]:
    return exc.messages if isinstance(exc, StepErrors) else [str(exc)]


def normalise(strategy: str, *, steps=None, scale_down_delay=None, preview=None, analysis=None,
              quality=None) -> tuple[list, float]:
    """(steps, scale_down_delay_s) for a strategy; raises ValidationError listing every problem."""
    errors: dict[str, list[str]] = {}
    out: list[dict] = []
    delay = 0.0
    if strategy == Strategy.CANARY:
        for name, value in (("scale_down_delay", scale_down_delay), ("preview", preview), ("analysis", analysis),
                            ("quality", quality)):
            if value is not None:
                errors[name] = [f"{name} applies to blue-green; a canary lists its steps."]
        raw = DEFAULT_CANARY_STEPS if steps is None else steps
        if not isinstance(raw, list):
            errors["steps"] = ["Expected a list of steps, e.g. [{\"set_weight\": 20}, {\"analysis\": \"2m\"}]."]
            raw = []
        if len(raw) > MAX_STEPS:
            errors["steps"] = [f"At most {MAX_STEPS} steps."]
            raw = []
        for index, step in enumerate(raw):
            try:
                out.append(_step(step, f"steps[{index}]"))
            except ValueError as exc:
                errors.setdefault("steps", []).extend(_messages(exc))
    elif strategy == Strategy.BLUE_GREEN:
        if steps is not None:
            errors["steps"] = ["A blue-green rollout has no steps: give preview, quality, analysis and "
                               "scale_down_delay."]
        try:
            delay = parse_duration("0s" if scale_down_delay is None else scale_down_delay, "scale_down_delay")
        except ValueError as exc:
            errors["scale_down_delay"] = [str(exc)]
        if quality is not None:  # scored on the preview route before anyone is sent there, and before the switch
            try:
                out.append(_step({"quality": quality}, "quality"))
            except ValueError as exc:
                errors["quality"] = [text.replace("quality.quality", "quality") for text in _messages(exc)]
        if preview is not None:  # keep the candidate on its preview route: for this long, or until promoted
            try:
                out.append(_step({"pause": preview}, "preview"))
            except ValueError as exc:
                errors["preview"] = [str(exc).replace("preview.pause", "preview")]
        out.append({"set_weight": 100})
        if analysis is not None:
            try:
                out.append(_step({"analysis": analysis}, "analysis"))
            except ValueError as exc:
                errors["analysis"] = [str(exc).replace("analysis.analysis", "analysis")]
    else:
        errors["strategy"] = [f"Unknown strategy {strategy!r}; use canary or blue-green."]
    if errors:
        raise ValidationError(errors)
    return out, delay


def watch_seconds(value) -> float:
    """The watch after success in seconds (default 10 minutes, 0 for none); ValidationError on `watch`."""
    if value is None:
        return DEFAULT_WATCH_S
    try:
        return parse_duration(value, "watch")
    except ValueError as exc:
        raise ValidationError({"watch": [str(exc)]}) from None


MAX_HOLDBACK_PERCENT = 50


def holdback_percent(value) -> int:
    """The holdback during the watch in percent (default INFEROPS_ROLLOUT_HOLDBACK_PERCENT); ValidationError
    on `holdback`."""
    if value is None:
        return settings.INFEROPS_ROLLOUT_HOLDBACK_PERCENT
    if type(value) is not int or not 0 <= value <= MAX_HOLDBACK_PERCENT:
        raise ValidationError({"holdback": [
            f"Expected an integer percent from 0 (no holdback) to {MAX_HOLDBACK_PERCENT}."]})
    return value


def watch_limits(steps: list) -> dict:
    """What the watch judges by: the rollout's last analysis (its max_burn_rate and min_requests), or
    the analysis defaults."""
    analyses = [step["analysis"] for step in steps if "analysis" in step]
    last = analyses[-1] if analyses else {}
    return {"max_burn_rate": last.get("max_burn_rate", DEFAULT_MAX_BURN_RATE),
            "min_requests": last.get("min_requests", DEFAULT_MIN_REQUESTS)}
