"""The autoscaler's decision: a pure function from recent samples to a replica count, with why.

It follows the Kubernetes HPA's algorithm and behaviour fields. Each sample gives every signal a
recommended replica count (proportional signals: `ceil(ready × value / target)`); a sample's
recommendation is the largest of its signals'. Scaling up takes the smallest recommendation over
`scale_up.stabilization_s` (the load must stay high), scaling down the largest over
`scale_down.stabilization_s` (it must stay low), each by at most `step` replicas, never within
`cooldown_s` of the last change, never while replicas it asked for are still starting (a cold
start must not read as missing capacity), and always within [min_replicas, max_replicas].

Scale to zero is its own rule: with `min_replicas` 0, a deployment idle (nothing running, waiting
or finished) for `park_after_s` parks; a request the gateway holds for it wakes it at once.
A degradation level's `scale_up` raises the floor above min_replicas: the same path for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from capacity.choices import DecisionKind

SIGNALS = ("waiting_per_replica", "kv_usage", "ttft_p95_headroom", "tpot_p95_headroom", "burn_rate",
           "goodput_headroom")
# How far back the latency signals look for their p95 at each sample: a few seconds hold too few requests.
LATENCY_WINDOW_S = 60.0


@dataclass(frozen=True)
class Step:
    step: int
    stabilization_s: float


@dataclass(frozen=True)
class Policy:
    minimum: int
    maximum: int
    signals: dict[str, float]  # signal name -> its target
    scale_up: Step = Step(1, 30)
    scale_down: Step = Step(1, 300)
    cooldown_s: float = 30
    park_after_s: float = 900


@dataclass(frozen=True)
class Targets:
    """What some signals are measured against: the deployment's SLO thresholds and its measured
    goodput capacity per replica (None where there is none)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    capacity_rps: float | None = None


@dataclass(frozen=True)
class Sample:
    """The deployment as one autoscaler tick saw it. Rates and histograms cover the time since the
    previous sample (None / empty on the first)."""

    at: float  # Unix seconds
    replicas: int  # asked for at the time
    ready: int
    waiting: float = 0.0  # summed over ready replicas
    running: float = 0.0
    kv: float = 0.0  # mean over ready replicas, 0..1
    rps: float | None = None  # requests finished per second
    ttft_buckets: dict[str, float] = field(default_factory=dict)  # {le: count} since the previous sample
    itl_buckets: dict[str, float] = field(default_factory=dict)
    burn: float | None = None  # the fastest burn rate among the deployment's SLOs
    held: bool = False  # a gateway holds requests for it

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0 and not self.rps and not self.held

    def as_json(self) -> dict:
        return {key: value for key, value in self.__dict__.items()}

    @classmethod
    def from_json(cls, data: dict) -> Sample:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


@dataclass(frozen=True)
class Decision:
    target: int
    kind: str = ""  # a DecisionKind; "" = no change
    reason: str = ""
    signals: dict[str, dict] = field(default_factory=dict)  # {signal: {value, target, replicas}} at the last sample

    @property
    def changes(self) -> bool:
        return bool(self.kind)


def quantile(q: float, buckets: dict[str, float]) -> float | None:
    """The q-quantile (seconds) of cumulative buckets {le: count}, interpolated inside its bucket."""
    bounds = sorted((float(le), count) for le, count in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * inside
        lower_bound, lower_count = bound, max(lower_count, count)
    return lower_bound


def _summed(samples: list[Sample], name: str) -> dict[str, float]:
    total: dict[str, float] = {}
    for sample in samples:
        for le, count in getattr(sample, name).items():
            total[le] = total.get(le, 0.0) + count
    return total


def measured(samples: list[Sample], index: int, targets: Targets) -> dict[str, float | None]:
    """Each signal's value at samples[index] (None: not measurable there)."""
    sample = samples[index]
    ready = sample.ready
    recent = [s for s in samples[: index + 1] if s.at > sample.at - LATENCY_WINDOW_S]
    ttft = quantile(0.95, _summed(recent, "ttft_buckets"))
    itl = quantile(0.95, _summed(recent, "itl_buckets"))
    return {
        "waiting_per_replica": sample.waiting / ready if ready else None,
        "kv_usage": sample.kv if ready else None,
        "ttft_p95_headroom": ttft * 1000 / targets.ttft_ms if ttft is not None and targets.ttft_ms else None,
        "tpot_p95_headroom": itl * 1000 / targets.tpot_ms if itl is not None and targets.tpot_ms else None,
        "burn_rate": sample.burn if ready else None,
        "goodput_headroom": (sample.rps / (targets.capacity_rps * ready)
                             if ready and sample.rps is not None and targets.capacity_rps else None),
    }


def recommend(name: str, value: float, target: float, ready: int) -> int:
    """Replicas one signal asks for at one sample."""
    if name == "burn_rate":
        # Not proportional to load: above target add one, below half of it give one back, else hold.
        return ready + 1 if value >= target else ready - 1 if value < target / 2 else ready
    # Proportional: the replicas at which the per-replica value would meet its target. A tiny
    # tolerance keeps float noise (0.8000001 of 0.8) from asking for one more.
    return math.ceil(ready * value / target - 1e-9)


def recommendations(samples: list[Sample], index: int, policy: Policy,
                    targets: Targets) -> tuple[int | None, dict[str, dict]]:
    """The replicas samples[index] asks for (None: no signal could tell) and each signal's part."""
    values = measured(samples, index, targets)
    ready = samples[index].ready
    parts = {}
    for name, target in policy.signals.items():
        value = values.get(name)
        if value is not None and ready:
            parts[name] = {"value": round(value, 4), "target": target,
                           "replicas": recommend(name, value, target, ready)}
    return (max(part["replicas"] for part in parts.values()) if parts else None), parts


def _window(samples: list[Sample], now: float, seconds: float) -> list[int] | None:
    """The indexes of the samples of the last `seconds` (at least the newest), or None when the
    series does not reach back that far yet (after a restart of the autoscaler, say)."""
    if not samples:
        return None
    if seconds <= 0:
        return [len(samples) - 1]
    if samples[0].at > now - seconds + 1:  # a second's grace for tick jitter
        return None
    return [i for i, s in enumerate(samples) if s.at >= now - seconds] or [len(samples) - 1]


def _why(parts: dict[str, dict], winner: int) -> str:
    named = [f"{name} {part['value']:g} vs target {part['target']:g} → {part['replicas']}"
             for name, part in parts.items() if part["replicas"] == winner] or ["no signal"]
    return "; ".join(named)


def decide(*, policy: Policy, samples: list[Sample], current: int, last_change_at: float | None, now: float,
           targets: Targets = Targets(), boost: int = 0) -> Decision:
    """The replica count to run now (samples oldest first; `boost`: replicas a degradation level asks
    for above min_replicas)."""
    floor = min(policy.maximum, policy.minimum + boost)
    latest = samples[-1] if samples else None
    parts = recommendations(samples, len(samples) - 1, policy, targets)[1] if samples else {}

    def decision(target: int, kind: str, reason: str) -> Decision:
        return Decision(target, kind, reason, parts)

    if current == 0:
        if latest is not None and latest.held:
            return decision(max(floor, 1), DecisionKind.WAKE, "a request is held by the gateway: starting from zero")
        if floor > 0:
            return decision(floor, DecisionKind.BOUND, _floor_reason(policy, boost))
        return Decision(0)
    if current < floor:
        return decision(floor, DecisionKind.BOUND, _floor_reason(policy, boost))
    if current > policy.maximum:
        return decision(policy.maximum, DecisionKind.BOUND, f"above max_replicas ({policy.maximum})")
    woken_long_ago = last_change_at is None or now - last_change_at >= policy.park_after_s
    if policy.minimum == 0 and floor == 0 and latest is not None and woken_long_ago:
        # Idle while serving: samples of the parked time before a wake (nothing ready) prove nothing.
        idle = _window(samples, now, policy.park_after_s)
        if idle is not None and all(samples[i].idle and samples[i].ready for i in idle):
            return decision(0, DecisionKind.PARK, f"idle for {policy.park_after_s:g} s: parked until the next request")
    if last_change_at is not None and now - last_change_at < policy.cooldown_s:
        return Decision(current, signals=parts)
    if latest is None or latest.ready < min(current, latest.replicas):
        return Decision(current, signals=parts)  # replicas still starting: their capacity is coming
    up = _window(samples, now, policy.scale_up.stabilization_s)
    if up is not None and current < policy.maximum:
        asked = [recommendations(samples, i, policy, targets)[0] for i in up]
        if None not in asked and min(asked) > current:
            target = min(min(asked), current + policy.scale_up.step, policy.maximum)
            return decision(target, DecisionKind.UP, _over(policy.scale_up.stabilization_s) + _why(parts, max(
                part["replicas"] for part in parts.values())))
    down = _window(samples, now, policy.scale_down.stabilization_s)
    lowest = max(floor, 1)
    if down is not None and current > lowest:
        asked = [recommendations(samples, i, policy, targets)[0] for i in down]
        if None not in asked and max(asked) < current:
            target = max(max(asked), current - policy.scale_down.step, lowest)
            return decision(target, DecisionKind.DOWN, _over(policy.scale_down.stabilization_s) + _why(parts, max(
                part["replicas"] for part in parts.values())))
    return Decision(current, signals=parts)


def _over(seconds: float) -> str:
    return f"for {seconds:g} s: " if seconds > 0 else ""


def _floor_reason(policy: Policy, boost: int) -> str:
    if boost:
        return f"degradation asks for {boost} more than min_replicas ({policy.minimum})"
    return f"below min_replicas ({policy.minimum})"
