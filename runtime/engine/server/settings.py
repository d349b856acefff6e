"""A replica's settings: fixed at start-up, except the faults, which POST /admin/faults changes."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.engine.config import GenerationDefaults
from runtime.engine.openai_protocol import bad_request

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
