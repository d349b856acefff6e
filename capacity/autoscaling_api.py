"""REST API of a deployment's autoscaling: the policy (GET/PUT) and the decisions it took."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django.urls import path
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from capacity.models import ScalingDecision, ScalingState
from capacity.policy import AutoscalingPolicySerializer, document, policy_context
from capacity.scaling import policy_save
from deployments.choices import ReplicaState
from deployments.models import Deployment
from inferops.api import ERRORS, ErrorSerializer, PlainMetadata

DECISIONS_SHOWN = 50
MAX_DECISIONS = 500
AUTOSCALING_ERRORS = {**ERRORS, 404: OpenApiResponse(ErrorSerializer, description="Unknown deployment.")}


class ScalingDecisionSerializer(serializers.ModelSerializer):
    class Meta:
        model = ScalingDecision
        fields = ["at", "kind", "from_replicas", "to_replicas", "reason", "signals"]


class AutoscalingSerializer(AutoscalingPolicySerializer):
    """What GET answers: the policy (defaults filled in), where the deployment stands, recent decisions."""

    replicas = serializers.IntegerField(help_text="Replicas asked for now (0: parked).")
    ready_replicas = serializers.IntegerField()
    parked = serializers.BooleanField()
    last_sample = serializers.DictField(allow_null=True, help_text=(
        "The autoscaler's newest sample: queue, running, KV usage, req/s, burn rate, and when."))
    decisions = ScalingDecisionSerializer(many=True, help_text=f"The newest {DECISIONS_SHOWN}, newest first.")


def autoscaling_document(deployment: Deployment) -> dict:
    state = ScalingState.objects.filter(deployment=deployment).first()
    last = dict(state.samples[-1]) if state and state.samples else None
    if last is not None:
        for key in ("raw", "ttft_buckets", "itl_buckets"):
            last.pop(key, None)
    return {
        **document(deployment), "replicas": deployment.replicas,
        "ready_replicas": deployment.replica_set.filter(state=ReplicaState.READY).count(),
        "parked": deployment.autoscale and deployment.replicas == 0,
        "last_sample": last,
        "decisions": ScalingDecisionSerializer(deployment.scaling_decisions.all()[:DECISIONS_SHOWN], many=True).data,
    }


def _deployment(name: str) -> Deployment:
    return get_object_or_404(Deployment.objects.select_related("model"), name=name, deleted_at__isnull=True)


class AutoscalingViewSet(viewsets.GenericViewSet):
    # A deployment's autoscaling policy (get, replace) and its decisions.
    # Comments, not a docstring: drf-spectacular would print a docstring as every operation's description.
    metadata_class = PlainMetadata
    pagination_class = None  # decisions: the newest `limit`, as a plain list

    @extend_schema(responses={200: AutoscalingSerializer, **AUTOSCALING_ERRORS},
                   summary="A deployment's autoscaling policy, where it stands and its recent decisions")
    def retrieve(self, request, name: str):
        return Response(autoscaling_document(_deployment(name)))

    @extend_schema(request=AutoscalingPolicySerializer, responses={200: AutoscalingSerializer, **AUTOSCALING_ERRORS},
                   summary="Replace a deployment's autoscaling policy")
    def update(self, request, name: str):
        deployment = _deployment(name)
        serializer = AutoscalingPolicySerializer(data=request.data, context=policy_context(deployment))
        serializer.is_valid(raise_exception=True)
        deployment = policy_save(deployment=deployment, actor=request.user, data=serializer.validated_data)
        return Response(autoscaling_document(deployment))

    @extend_schema(responses={200: ScalingDecisionSerializer(many=True), **AUTOSCALING_ERRORS},
                   parameters=[OpenApiParameter("limit", int, description=f"At most this many, newest first "
                                                                          f"(default 100, at most {MAX_DECISIONS}).")],
                   summary="The autoscaler's decisions for a deployment, newest first")
    @action(detail=True, methods=["get"])
    def decisions(self, request, name: str):
        deployment = _deployment(name)
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DECISIONS:
            raise serializers.ValidationError({"limit": [f"A whole number from 1 to {MAX_DECISIONS}."]})
        return Response(ScalingDecisionSerializer(deployment.scaling_decisions.all()[: int(raw)], many=True).data)


urlpatterns = [
    path("deployments/<str:name>/autoscaling/", AutoscalingViewSet.as_view({"get": "retrieve", "put": "update"}),
         name="api-autoscaling"),
    path("deployments/<str:name>/autoscaling/decisions/", AutoscalingViewSet.as_view({"get": "decisions"}),
         name="api-autoscaling-decisions"),
]
