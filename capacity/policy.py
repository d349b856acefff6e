"""A deployment's autoscaling policy: defaults, validation, and the policy the autoscaler reads.

On/off and the bounds stay in the deployment's own columns (`autoscale`, `min_replicas`,
`max_replicas`), which the deployment API and the degradation policy read; the rest is the
deployment's `autoscaling` document. `scaling.policy_save` writes both at once and audits the change.
"""

from __future__ import annotations

from django.db.models import Q
from rest_framework import serializers

from capacity.autoscaler import SIGNALS, Policy, Step
from deployments.models import Deployment
from inferops.api import RejectUnknownFields
from runtime.gateway.contract import DEFAULT_HOLD_MAX_QUEUE, DEFAULT_HOLD_MAX_WAIT_S
from slo.choices import SliKind
from slo.engine_targets import deployment_targets
from slo.models import Slo

MAX_REPLICAS = 256  # as the deployment API allows
MAX_WINDOW_S = 3600
# The global policy's thresholds before policies were per deployment, as the defaults.
DEFAULT_SIGNALS = {"waiting_per_replica": 2.0, "kv_usage": 0.85}
DEFAULTS = {
    "signals": DEFAULT_SIGNALS,
    "scale_up": {"step": 1, "stabilization_s": 30},
    "scale_down": {"step": 1, "stabilization_s": 300},
    "cooldown_s": 30,
    "park_after_s": 900,
    "hold": {"max_wait_s": DEFAULT_HOLD_MAX_WAIT_S, "max_queue": DEFAULT_HOLD_MAX_QUEUE},
}
# What each signal's target means, and its bounds (exclusive low, inclusive high).
SIGNAL_TARGETS = {
    "waiting_per_replica": ("requests waiting per replica", 0, 1000),
    "kv_usage": ("KV-cache usage, 0-1", 0, 1),
    "ttft_p95_headroom": ("the share of the SLO's TTFT threshold the p95 may reach, 0-1", 0, 1),
    "tpot_p95_headroom": ("the share of the SLO's TPOT threshold the p95 may reach, 0-1", 0, 1),
    "burn_rate": ("the SLO burn rate (5m window) at which to add a replica", 0, 1000),
    "goodput_headroom": ("the share of the measured goodput capacity per replica to run at, 0-1", 0, 1),
}
assert set(SIGNAL_TARGETS) == set(SIGNALS)


def document(deployment: Deployment) -> dict:
    """The whole policy, defaults filled in."""
    stored = deployment.autoscaling or {}
    merged = {key: stored.get(key, default) for key, default in DEFAULTS.items()}
    for key in ("scale_up", "scale_down", "hold"):
        merged[key] = {**DEFAULTS[key], **(stored.get(key) or {})}
    return {"enabled": deployment.autoscale, "min_replicas": deployment.min_replicas,
            "max_replicas": deployment.max_replicas, **merged}


def policy_of(deployment: Deployment) -> Policy:
    doc = document(deployment)
    return Policy(
        minimum=doc["min_replicas"], maximum=doc["max_replicas"], signals=dict(doc["signals"]),
        scale_up=Step(doc["scale_up"]["step"], doc["scale_up"]["stabilization_s"]),
        scale_down=Step(doc["scale_down"]["step"], doc["scale_down"]["stabilization_s"]),
        cooldown_s=doc["cooldown_s"], park_after_s=doc["park_after_s"],
    )


class Strict(RejectUnknownFields, serializers.Serializer):
    """Unknown keys are refused with a 400 naming each of them, at any depth."""


class ScalingStepSerializer(Strict):
    # A key left out keeps its default (policy.DEFAULTS).
    step = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, required=False,
                                    help_text="At most this many replicas a change.")
    stabilization_s = serializers.FloatField(
        min_value=0, max_value=MAX_WINDOW_S, required=False,
        help_text="The load must ask for the change over this whole window (0: the latest sample decides).")


class HoldLimitsSerializer(Strict):
    # A key left out keeps its default (policy.DEFAULTS), as in ScalingStepSerializer.
    max_wait_s = serializers.FloatField(min_value=1, max_value=600, required=False,
                                        help_text="How long a gateway holds a request for a parked deployment.")
    max_queue = serializers.IntegerField(min_value=1, max_value=10000, required=False,
                                         help_text="How many requests a gateway holds for it at most.")


class AutoscalingPolicySerializer(Strict):
    enabled = serializers.BooleanField()
    min_replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS,
                                            help_text="0 lets the deployment park when idle (scale to zero).")
    max_replicas = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS)
    signals = serializers.DictField(child=serializers.FloatField(), required=False, help_text=(
        "Signal name -> target: " + "; ".join(f"{name}: {meaning}" for name, (meaning, _, _) in SIGNAL_TARGETS.items())
        + ". The autoscaler runs the most replicas any of them asks for."))
    scale_up = ScalingStepSerializer(required=False)
    scale_down = ScalingStepSerializer(required=False)
    cooldown_s = serializers.FloatField(min_value=0, max_value=MAX_WINDOW_S, required=False,
                                        help_text="No change within this long of the last one.")
    park_after_s = serializers.FloatField(min_value=30, max_value=86400, required=False,
                                          help_text="With min_replicas 0: park after this long without a request.")
    hold = HoldLimitsSerializer(required=False)

    def validate_signals(self, value: dict) -> dict:
        if not value:
            raise serializers.ValidationError("Name at least one signal: " + ", ".join(SIGNALS) + ".")
        errors = []
        for name, target in value.items():
            if name not in SIGNAL_TARGETS:
                errors.append(f"Unknown signal {name!r}: one of " + ", ".join(SIGNALS) + ".")
                continue
            meaning, low, high = SIGNAL_TARGETS[name]
            if not low < target <= high:
                errors.append(f"{name}: the target is {meaning}; give a number above {low:g} and at most {high:g}.")
        if errors:
            raise serializers.ValidationError(errors)
        return value

    def validate(self, attrs):
        if "min_replicas" in attrs and "max_replicas" in attrs and attrs["min_replicas"] > attrs["max_replicas"]:
            raise serializers.ValidationError({"min_replicas": [
                f"min_replicas ({attrs['min_replicas']}) exceeds max_replicas ({attrs['max_replicas']})."]})
        deployment: Deployment = self.context["deployment"]
        targets = self.context.get("slo_targets") or {}
        signals = attrs.get("signals") or {}
        missing = {"ttft_p95_headroom": "ttft_ms", "tpot_p95_headroom": "tpot_ms"}
        errors = [f"{name} needs an SLO threshold to measure against, and no latency or goodput SLO of "
                  f"{deployment.name!r} sets {field}: add one, or drop the signal."
                  for name, field in missing.items() if name in signals and not targets.get(field)]
        if "burn_rate" in signals and not self.context.get("has_slo"):
            errors.append(f"burn_rate needs an SLO of {deployment.name!r} to burn: add one, or drop the signal.")
        if errors:
            raise serializers.ValidationError({"signals": errors})
        return attrs


def policy_context(deployment: Deployment) -> dict:
    """What AutoscalingPolicySerializer checks a policy against: the SLO thresholds and whether any SLO can burn."""
    slos = Slo.objects.filter(Q(deployment=deployment) | Q(model_id=deployment.model_id, deployment__isnull=True))
    return {"deployment": deployment, "slo_targets": deployment_targets(deployment),
            "has_slo": slos.exclude(sli_kind=SliKind.QUALITY).exists()}
