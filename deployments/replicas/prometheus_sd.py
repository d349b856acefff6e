"""Prometheus HTTP service discovery: every ready replica and every live gateway as scrape targets.

A team's own Prometheus points an `http_sd_config` here with a viewer's API token in its
`authorization` block (sent as `Authorization: Bearer <token>`) and scrapes what inferops scrapes.
Replica targets carry the `deployment`, `version`, `replica` and `track` labels the exported SLO
rules (slo/prometheus_rules.py) select on. Gateway targets carry no `deployment` label: their
series have their own, and a target label of the same name would rename it `exported_deployment`.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from redis.exceptions import RedisError
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments.choices import ACTIVE_ROLLOUT, ReplicaState
from deployments.models import Replica
from deployments.replicas.reconcile import plan_tracks
from inferops.api import ERRORS
from inferops.prometheus_auth import SCRAPER_AUTHENTICATION
from inferops.redis_client import redis_client
from inferops.roles import VIEWER
from runtime.gateway.contract import GATEWAY_STALE_S, GATEWAYS_KEY

METRICS_PATH = "/metrics"


def replica_targets() -> list[dict]:
    ready = list(Replica.objects.filter(state=ReplicaState.READY).exclude(url="")
                 .select_related("deployment", "version").order_by("deployment__name", "id"))
    deployments = {r.deployment_id: r.deployment for r in ready}
    rollouts = {d.pk: d.rollouts.filter(status__in=ACTIVE_ROLLOUT).order_by("-id").first()
                for d in deployments.values()}
    now = timezone.now()
    tracks = {pk: plan_tracks(d, rollouts[pk], now) for pk, d in deployments.items()}
    groups = []
    for replica in ready:
        url = urlsplit(replica.url)
        track = next((t.name for t in tracks[replica.deployment_id] if t.matches(replica)), "outdated")
        groups.append({"targets": [url.netloc], "labels": {
            "__metrics_path__": METRICS_PATH,
            "__scheme__": url.scheme or "http",
            "component": "replica",
            "deployment": replica.deployment.name,
            "version": str(replica.version.number),
            "replica": str(replica.pk),
            "track": track,
            "backend": replica.deployment.backend,
        }})
    return groups


def gateway_targets(now: float | None = None) -> list[dict]:
    """Gateways whose heartbeat (runtime/gateway/heartbeat.py) is recent; none while Redis is down."""
    now = time.time() if now is None else now
    try:
        entries = redis_client().hgetall(GATEWAYS_KEY)
    except (RedisError, OSError):
        return []
    groups = []
    for raw in sorted(entries.values()):
        entry = json.loads(raw)
        if now - entry.get("seen_at", 0) > GATEWAY_STALE_S:
            continue
        groups.append({"targets": [entry["address"]], "labels": {
            "__metrics_path__": entry.get("metrics_path", METRICS_PATH),
            "component": "gateway",
            "gateway": entry["instance"],
        }})
    return groups


TARGET_GROUPS = inline_serializer("PrometheusTargetGroup", many=True, fields={
    "targets": serializers.ListField(child=serializers.CharField(), help_text="host:port"),
    "labels": serializers.DictField(child=serializers.CharField()),
})


@extend_schema(tags=["prometheus"], responses={200: TARGET_GROUPS, **ERRORS},
               summary="Scrape targets in Prometheus' http_sd_config format",
               description="Every ready replica (labels deployment, version, replica, track) and every "
                           "gateway that sent a heartbeat recently. Authenticate as Prometheus does: "
                           "`authorization: {credentials: <viewer API token>}`.")
class PrometheusTargets(APIView):
    authentication_classes = SCRAPER_AUTHENTICATION
    read_role = VIEWER

    def get(self, request):
        return Response(replica_targets() + gateway_targets())


