"""REST API of a deployment's degradation: the policy and its state (GET/PUT), operator overrides."""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from degradation import quality, services
from degradation.engine import covering_slos
from degradation.models import DegradationPolicy, DegradationState
from deployments.models import Deployment
from inferops.api import ERRORS, ErrorSerializer, PlainMetadata, RejectUnknownFields
from inferops.timeparse import DURATION_HINT, parse_duration, parse_time
from inferops.validators import slug_validator
from slo.models import Slo

MAX_LEVELS = 8
MAX_OVERRIDE = timedelta(days=7)
DEGRADATION_ERRORS = {**ERRORS, 404: OpenApiResponse(ErrorSerializer, description=(
    "Unknown deployment, or (GET) it has no degradation policy yet."))}


class Strict(RejectUnknownFields, serializers.Serializer):
    """Unknown keys are refused with a 400 naming each of them, at any depth."""


class FallbackSerializer(Strict):
    deployment = serializers.CharField(max_length=63, help_text="A deployment serving a compatible model.")
    weight = serializers.IntegerField(min_value=0, max_value=100, default=0,
                                      help_text="Percent of the other requests sent there.")
    priorities = serializers.ListField(child=serializers.IntegerField(), default=list, max_length=64,
                                       help_text="Requests of these priorities all go there.")

    def validate(self, attrs):
        if not attrs["weight"] and not attrs["priorities"]:
            raise serializers.ValidationError({"weight": ["Give a weight above 0 or some priorities: "
                                                          "as it stands the fallback takes nothing."]})
        return attrs


class ActionsSerializer(Strict):
    shed_below_priority = serializers.IntegerField(required=False, allow_null=True, help_text=(
        "Requests of a lower priority (their key's, or lower if the client asked) get 503 `degraded`."))
    max_tokens_cap = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                              help_text="max_tokens / max_completion_tokens above it are lowered.")
    fallback = FallbackSerializer(required=False, allow_null=True)
    scale_up = serializers.IntegerField(min_value=1, max_value=64, required=False, allow_null=True,
                                        help_text="Ask the autoscaler for up to this many more replicas.")
    freeze_rollouts = serializers.BooleanField(required=False, default=False,
                                               help_text="No new rollout starts; running canaries pause.")

    def validate(self, attrs):
        if not any(attrs.get(name) for name in services.ACTION_NAMES):
            raise serializers.ValidationError(
                f"A level needs at least one action: {', '.join(services.ACTION_NAMES)}.")
        # Judged per level, so one level's bad field does not hide another's bad fallback.
        if errors := _check_actions(attrs, self.context["deployment"]):
            raise serializers.ValidationError(errors)
        return attrs


class LevelSerializer(Strict):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    enter_burn_rate = serializers.FloatField(min_value=0.0, help_text="Entered when the worst burn reaches this.")
    exit_burn_rate = serializers.FloatField(min_value=0.0, help_text="Left when it falls below this (<= entry).")
    actions = ActionsSerializer()

    def validate(self, attrs):
        if attrs["enter_burn_rate"] <= 0:
            raise serializers.ValidationError({"enter_burn_rate": ["Must be above 0 (1 = burning the budget "
                                                                   "exactly as fast as the window allows)."]})
        if attrs["exit_burn_rate"] > attrs["enter_burn_rate"]:
            raise serializers.ValidationError({"exit_burn_rate": [
                f"The exit rate ({attrs['exit_burn_rate']:g}) must not be above the entry rate "
                f"({attrs['enter_burn_rate']:g}), or the level would flap."]})
        return attrs


class PolicySerializer(Strict):
    enabled = serializers.BooleanField(default=True)
    window = serializers.CharField(default="5m", help_text="Burn-rate window, whole minutes from 1m to 1h.")
    hold_s = serializers.IntegerField(min_value=0, max_value=86400, default=60,
                                      help_text="Seconds a level is held at least, either way.")
    slos = serializers.ListField(child=serializers.CharField(max_length=63), default=list, help_text=(
        "SLO names to watch; empty: every SLO of the deployment (or of its model)."))
    levels = LevelSerializer(many=True, help_text="Level 1 first; entry rates increase.")

    def validate_window(self, value: str) -> int:
        try:
            seconds = parse_duration(value, "window")
        except ValueError:
            raise serializers.ValidationError(f"Expected {DURATION_HINT}.") from None
        if seconds % 60 or not 60 <= seconds <= 3600:
            raise serializers.ValidationError("Give whole minutes from 1m to 1h (the SLIs are per minute).")
        return int(seconds // 60)

    def validate_levels(self, levels: list[dict]) -> list[dict]:
        if not levels or len(levels) > MAX_LEVELS:
            raise serializers.ValidationError(f"Give 1 to {MAX_LEVELS} levels.")
        errors: dict[str, dict] = defaultdict(dict)  # keyed by index, as DRF reports a list's items
        names = set()
        for index, level in enumerate(levels):
            if level["name"] in names:
                errors[str(index)]["name"] = [f"Two levels are named {level['name']!r}."]
            names.add(level["name"])
            if index and level["enter_burn_rate"] <= levels[index - 1]["enter_burn_rate"]:
                errors[str(index)]["enter_burn_rate"] = [
                    f"Levels must increase: level {index + 1}'s entry rate ({level['enter_burn_rate']:g}) must be "
                    f"above level {index}'s ({levels[index - 1]['enter_burn_rate']:g})."]
        if errors:
            raise serializers.ValidationError(dict(errors))
        return levels

    def validate_slos(self, names: list[str]) -> list[Slo]:
        deployment: Deployment = self.context["deployment"]
        covering = {slo.name: slo for slo in covering_slos(deployment)}
        unknown = [name for name in names if name not in covering]
        if unknown:
            elsewhere = set(Slo.objects.filter(name__in=unknown).values_list("name", flat=True))
            raise serializers.ValidationError([
                f"SLO {name!r} does not cover {deployment.name!r}." if name in elsewhere
                else f"Unknown SLO {name!r}; known for {deployment.name!r}: {', '.join(sorted(covering)) or 'none'}."
                for name in unknown])
        return [covering[name] for name in dict.fromkeys(names)]


def _check_actions(actions: dict, deployment: Deployment) -> dict:
    errors: dict = {}
    fallback = actions.get("fallback")
    if fallback:
        name = fallback["deployment"]
        target = Deployment.objects.filter(name=name, deleted_at__isnull=True).select_related("model").first()
        if name == deployment.name:
            errors["fallback"] = {"deployment": ["A deployment cannot fall back to itself."]}
        elif target is None:
            errors["fallback"] = {"deployment": [f"Unknown deployment {name!r}."]}
        elif target.model.task != deployment.model.task:
            errors["fallback"] = {"deployment": [
                f"{name!r} serves {target.model.task} requests, {deployment.name!r} serves "
                f"{deployment.model.task}: a fallback must take the same requests."]}
    if actions.get("scale_up") and not (deployment.autoscale and deployment.max_replicas > deployment.min_replicas):
        errors["scale_up"] = [
            f"scale_up asks the autoscaler for replicas: turn autoscaling on for {deployment.name!r} and give "
            f"max_replicas room above min_replicas ({deployment.min_replicas} to {deployment.max_replicas} now)."]
    return errors


class OverrideSerializer(Strict):
    level = serializers.IntegerField(min_value=0, help_text="The level to hold; 0 turns degradation off.")
    until = serializers.CharField(help_text='An ISO 8601 time, or a duration from now such as "30m".')
    reason = serializers.CharField(max_length=2000, help_text="Why; recorded with the change and in the audit log.")

    def validate_until(self, value: str):
        now = timezone.now()
        try:
            until = now + timedelta(seconds=parse_duration(value, "until"))
        except ValueError:
            try:
                until = parse_time(value, "until")
            except ValueError:
                raise serializers.ValidationError(f"Expected an ISO 8601 time or {DURATION_HINT}.") from None
        if not now < until <= now + MAX_OVERRIDE:
            raise serializers.ValidationError("Give a time in the future, at most 7 days ahead.")
        return until

    def validate_level(self, value: int) -> int:
        policy: DegradationPolicy = self.context["policy"]
        if value > len(policy.levels):
            raise serializers.ValidationError(f"The policy has levels 0 to {len(policy.levels)}.")
        return value


class ClearSerializer(Strict):
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")


# ---------------------------------------------------------------------------- documents


def state_document(deployment: Deployment, policy: DegradationPolicy | None) -> dict:
    state = DegradationState.objects.filter(deployment=deployment).select_related("override_by").first()
    state = state or DegradationState(deployment=deployment)
    override = None
    if state.override_until is not None:
        override = {"level": state.override_level, "until": state.override_until, "reason": state.override_reason,
                    "by": state.override_by.username if state.override_by else None}
    return {
        "level": state.level, "level_name": services.level_name(policy, state.level), "since": state.since,
        "burn_rates": state.burn_rates, "evaluated_at": state.evaluated_at, "override": override,
        "actions": deployment.degradation,
        "history": [{"at": change.at, "from": change.from_level, "to": change.to_level, "reason": change.reason,
                     "burn_rates": change.burn_rates, "by": change.actor.username if change.actor else None}
                    for change in services.history(deployment)],
    }


def quality_document(deployment: Deployment, policy: DegradationPolicy) -> dict:
    """Each fallback's eval scores beside the deployment's, and a warning where a fallback scores lower."""
    fallbacks = quality.fallback_quality(deployment, policy.levels)
    return {"fallbacks": fallbacks, "warnings": quality.fallback_warnings(deployment, fallbacks)}


def degradation_document(deployment: Deployment, policy: DegradationPolicy) -> dict:
    return {**services.policy_document(policy), **state_document(deployment, policy),
            **quality_document(deployment, policy)}


class HistoryEntrySerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    to = serializers.IntegerField()
    reason = serializers.CharField()
    burn_rates = serializers.DictField(child=serializers.FloatField())
    by = serializers.CharField(allow_null=True, help_text="The operator who forced it; null: the policy.")

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = serializers.IntegerField()  # a keyword in Python
        return fields


class OverrideStateSerializer(serializers.Serializer):
    level = serializers.IntegerField()
    until = serializers.DateTimeField()
    reason = serializers.CharField()
    by = serializers.CharField(allow_null=True)


class RunScoreSerializer(serializers.Serializer):
    score = serializers.FloatField()
    set_version = serializers.IntegerField()
    run = serializers.IntegerField(help_text="The eval run that gives the score.")


class SetScoresSerializer(serializers.Serializer):
    eval_set = serializers.CharField()
    fallback = RunScoreSerializer(allow_null=True)
    own = RunScoreSerializer(allow_null=True, help_text="The deployment's own score on the set.")


class FallbackLevelSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    name = serializers.CharField()


class FallbackQualitySerializer(serializers.Serializer):
    deployment = serializers.CharField()
    version = serializers.IntegerField()
    levels = FallbackLevelSerializer(many=True, help_text="The levels that send requests there.")
    scores = SetScoresSerializer(many=True)


class DegradationSerializer(PolicySerializer):
    """What GET answers: the policy, then where the deployment stands."""

    slos = serializers.ListField(child=serializers.CharField())
    level = serializers.IntegerField(help_text="0: normal.")
    level_name = serializers.CharField()
    since = serializers.DateTimeField(allow_null=True)
    burn_rates = serializers.DictField(child=serializers.FloatField(),
                                       help_text="SLO name -> burn over the window at the last cycle.")
    evaluated_at = serializers.DateTimeField(allow_null=True)
    override = OverrideStateSerializer(allow_null=True)
    actions = serializers.DictField(allow_null=True, help_text="The actions in force (what gateways apply).")
    history = HistoryEntrySerializer(many=True)
    fallbacks = FallbackQualitySerializer(many=True, help_text=(
        "Per fallback deployment of the levels: the version it serves and, per eval set, its score and the "
        "deployment's own (latest succeeded run of the version each serves; null: no score)."))
    warnings = serializers.ListField(child=serializers.CharField(), help_text=(
        "What looks wrong without being refused: a fallback that scores lower than the deployment on an eval set."))


def _deployment(name: str) -> Deployment:
    return get_object_or_404(Deployment.objects.select_related("model"), name=name, deleted_at__isnull=True)


class DegradationViewSet(viewsets.GenericViewSet):
    # A deployment's one policy (get, create or replace) and the operator's override of its level.
    # Comments, not a docstring: drf-spectacular would print a docstring as every operation's description.
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    @extend_schema(responses={200: DegradationSerializer, **DEGRADATION_ERRORS},
                   summary="A deployment's degradation policy and where it stands")
    def retrieve(self, request, name: str):
        deployment = _deployment(name)
        policy = DegradationPolicy.objects.filter(deployment=deployment).first()
        if policy is None:
            return Response({"detail": f"{name!r} has no degradation policy yet: PUT one here."}, status=404)
        return Response(degradation_document(deployment, policy))

    @extend_schema(request=PolicySerializer, responses={200: DegradationSerializer, **DEGRADATION_ERRORS},
                   summary="Create or replace a deployment's degradation policy")
    def update(self, request, name: str):
        deployment = _deployment(name)
        serializer = PolicySerializer(data=request.data, context={"deployment": deployment})
        serializer.is_valid(raise_exception=True)
        policy = policy_save_validated(deployment=deployment, actor=request.user, data=serializer.validated_data)
        deployment.refresh_from_db(fields=["degradation"])
        return Response(degradation_document(deployment, policy))

    @extend_schema(request=OverrideSerializer, responses={200: DegradationSerializer, **DEGRADATION_ERRORS},
                   summary="Hold a degradation level (0: off) until a time, with a reason")
    @action(detail=True, methods=["post"])
    def override(self, request, name: str):
        deployment = _deployment(name)
        policy = get_object_or_404(DegradationPolicy, deployment=deployment)
        serializer = OverrideSerializer(data=request.data, context={"policy": policy})
        serializer.is_valid(raise_exception=True)
        services.override_set(deployment=deployment, actor=request.user, **serializer.validated_data)
        deployment.refresh_from_db(fields=["degradation"])
        return Response(degradation_document(deployment, policy))

    @extend_schema(request=ClearSerializer, responses={200: DegradationSerializer, **DEGRADATION_ERRORS},
                   summary="End an override now; the policy decides again at the next cycle")
    @override.mapping.delete
    def override_clear(self, request, name: str):
        deployment = _deployment(name)
        policy = get_object_or_404(DegradationPolicy, deployment=deployment)
        serializer = ClearSerializer(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        services.override_clear(deployment=deployment, actor=request.user, reason=serializer.validated_data["reason"])
        return Response(degradation_document(deployment, policy))


def policy_save_validated(*, deployment: Deployment, actor, data: dict) -> DegradationPolicy:
    """services.policy_save from PolicySerializer's validated data (the API's PUT and the console's form)."""
    return services.policy_save(deployment=deployment, actor=actor, enabled=data["enabled"],
                                window_minutes=data["window"], hold_s=data["hold_s"], slos=data["slos"],
                                levels=_plain(data["levels"]))


def _plain(levels: list) -> list[dict]:
    """Validated levels as plain JSON (OrderedDicts, nested), with absent actions left out."""
    plain = []
    for level in levels:
        actions = {key: value for key, value in level["actions"].items() if value not in (None, False)}
        if "fallback" in actions:
            actions["fallback"] = dict(actions["fallback"])
        plain.append({"name": level["name"], "enter_burn_rate": level["enter_burn_rate"],
                      "exit_burn_rate": level["exit_burn_rate"], "actions": actions})
    return plain
