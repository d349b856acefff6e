"""A replica's settings: fixed at start-up, except the faults (POST /admin/faults) and the SLO
targets the control plane sets (POST /admin/slo-targets)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.engine.config import GenerationDefaults
from runtime.engine.openai_protocol import bad_request
from runtime.engine.slo_scheduling import SloTargets

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class FaultSettings:
    """Injected faults; changeable at run time through POST /admin/faults."""

    fault_ttft_ms: float = 0.0
    fault_tpot_ms: float = 0.0
    fault_error_rate: float = 0.0

    def update(self, body: Any) -> None:
        """Validate every field first so a bad update changes nothing."""
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", "body")
        unknown = set(body) - set(asdict(self))
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"Unrecognized fault setting `{name}`.", name)
        changes = {}
        for name, value in body.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"`{name}` must be a number.", name)
            if value < 0 or (name == "fault_error_rate" and value > 1):
                limit = "between 0 and 1" if name == "fault_error_rate" else ">= 0"
                raise bad_request(f"`{name}` must be {limit}, got {value}.", name)
            changes[name] = float(value)
        for name, value in changes.items():
            setattr(self, name, value)

    def draw_error(self) -> bool:
        return self.fault_error_rate > 0 and random.random() < self.fault_error_rate


# The largest target accepted, in ms: a day; anything longer is a typo, not an SLO.
MAX_TARGET_MS = 86_400_000


def target_ms(value: Any, name: str) -> float | None:
    """A positive number of milliseconds, or None; raises a 400 naming the field otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TARGET_MS:
        raise bad_request(f"`{name}` must be a number of milliseconds above 0 and at most {MAX_TARGET_MS}, "
                          f"or null for the engine's default; got {value!r}.", name)
    return float(value)


@dataclass
class SloTargetSettings:
    """The replica-wide TTFT and TPOT targets: the control plane's (from the deployment's latency
    SLOs, POST /admin/slo-targets), each falling back to the engine's default (--slo-ttft-ms,
    --slo-tpot-ms). A request's own targets (the gateway's headers, from its tenant's SLO) win."""

    engine_default: SloTargets
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def update(self, body: Any) -> None:
        """Validates the whole body first so a bad update changes nothing."""
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", "body")
        unknown = set(body) - {"ttft_ms", "tpot_ms"}
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"Unrecognized target `{name}` (known: ttft_ms, tpot_ms).", name)
        changes = {name: target_ms(value, name) for name, value in body.items()}
        for name, value in changes.items():
            setattr(self, name, value)

    @property
    def effective(self) -> SloTargets:
        return SloTargets.from_ms(self.ttft_ms, self.tpot_ms).or_else(self.engine_default)

    def as_json(self) -> dict[str, Any]:
        effective = self.effective
        return {"ttft_ms": None if effective.ttft_s is None else effective.ttft_s * 1000,
                "tpot_ms": None if effective.tpot_s is None else effective.tpot_s * 1000,
                "source": "control-plane" if (self.ttft_ms, self.tpot_ms) != (None, None) else "engine"}


@dataclass
class ServerSettings:
    served_model_name: str
    model_root: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_token: str | None = None
    faults: FaultSettings = field(default_factory=FaultSettings)
    histogram_buckets: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # What a request leaves out: OpenAI's defaults or the checkpoint's generation_config.json.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    slo_targets: SloTargetSettings = field(
        default_factory=lambda: SloTargetSettings(SloTargets.from_ms(2000.0, 200.0)))
    scheduling_policy: str = "priority"
    # --slo-reject-late: a stream's headers wait for its first token, so a late refusal is a 503.
    slo_reject_late: bool = False
