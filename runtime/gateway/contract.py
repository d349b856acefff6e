"""The Redis contract between the control plane and the gateways, defined once.

The control plane publishes two tables, each a hash with a generation counter and a channel that
announces changes; gateways keep their last copy in memory. Gateways append one usage event per
request to a stream that the control plane ingests. Both sides import these names from here.

- ROUTING_KEY: route name -> JSON {deployment, model, task, backend, versions: [{version, track,
  weight, replicas: [{id, url}]}], published_at, degradation}. A `<deployment>--preview` route is
  a rollout's candidate alone. `degradation` is null at level 0, else the actions the gateway
  applies: {level, name, shed_below_priority, max_tokens_cap, fallback: {deployment, weight,
  priorities}, retry_after_s} (each action null when the level has none). `scale_from_zero` is
  null unless the deployment may park (autoscaling on, min_replicas 0); then {max_wait_s,
  max_queue}: while no replica is ready, a gateway holds up to max_queue requests for it (per
  gateway) for up to max_wait_s each, and asks for a replica in ACTIVATION_KEY.
- ACTIVATION_KEY: deployment -> JSON {at (Unix s), held (requests this gateway holds), gateway
  (instance)}, set by a gateway holding requests for a parked deployment (and again every
  ACTIVATION_REFRESH_S while it holds any), announced on ACTIVATION_CHANNEL; the control plane
  starts a replica and deletes the field. Held requests are released by the routing table
  that lists the new replica.
- DEGRADATION_KEY: deployment (with a degradation policy) -> JSON {degradation: as in ROUTING_KEY,
  ttft_deadlines_ms: [ms, ...], published_at}, published the moment a level or the deadlines
  change; the routing entry gets the level from the next reconcile pass (which heals a lost
  publish), and a gateway applies whichever of the two was published later.
- TTFT verdicts: gateways count each streamed request to a deployment with deadlines against each
  deadline when its first token arrives, or as bad when the deadline passes first, so a burn shows
  while an overload lasts rather than as its requests end. Kept apart from the usage stream (the
  exact SLIs still come from usage events): a hash per deployment and Unix minute,
  `ttft_verdicts_key()`, fields `<deadline ms>:<second of the minute>:<good|bad>`.
- SLO_TARGETS_KEY: `<deployment>:<tenant>` -> JSON {ttft_ms, tpot_ms} (either null), the tightest
  targets of the tenant's latency and goodput SLOs on that deployment; replaced whole on every
  publish. The gateway sends them to built-in replicas as SLO_TTFT_HEADER / SLO_TPOT_HEADER (a
  client's own copies of those headers are dropped), so the engine schedules each request for its
  tenant's promise; requests without them get the deployment's targets, which the control plane
  pushes to each replica (POST /admin/slo-targets).
- KEYS_KEY: sha256 hex of an API key -> JSON {prefix, name, tenant, deployments, priority,
  expires_at, limits: {key, tenant}}; replaced whole on every publish.
- USAGE_STREAM: entries {"e": JSON event}, one per request (tenants/ingest.py says which fields).
  `request_id` is always the gateway's own id (ingestion is idempotent by it, so a client that
  reuses an id loses no usage); `client_request_id` is the client's X-Request-Id when usable.
  `ttft_source` says who measured `ttft_ms`/`tpot_ms`: "gateway" (a stream), "server" (a whole
  answer, from the replica's Server-Timing header), null when neither did.
  `held_ms` is how long the gateway held the request while its parked deployment started a replica
  (null when not held; about 0 when refused by a full hold queue); `ttft_ms` includes it.
  `batch_id` (1-64 characters) marks a line of an offline batch (/v1/batches), written by the batch
  runner rather than a gateway: `priority` -1000, `stream` false, `request_id`
  `<batch_id>-<hash of custom_id>` (so a re-run line is stored and billed once). Batch events count
  in usage, errors and cost (at the batch price) and in availability SLIs, never in latency or
  goodput SLIs nor the latency roll-ups; absent (null) on interactive requests.
"""

from __future__ import annotations

import hashlib

ROUTING_KEY = "inferops:routing"
ROUTING_GENERATION_KEY = "inferops:routing:generation"
ROUTING_CHANNEL = "inferops:routing:changed"
DEGRADATION_KEY = "inferops:degradation"
DEGRADATION_GENERATION_KEY = "inferops:degradation:generation"
DEGRADATION_CHANNEL = "inferops:degradation:changed"
TTFT_VERDICTS_PREFIX = "inferops:ttft-verdicts"
TTFT_VERDICTS_TTL_S = 900
KEYS_KEY = "inferops:keys"
KEYS_GENERATION_KEY = "inferops:keys:generation"
KEYS_CHANNEL = "inferops:keys:changed"
SLO_TARGETS_KEY = "inferops:slo-targets"
SLO_TARGETS_GENERATION_KEY = "inferops:slo-targets:generation"
SLO_TARGETS_CHANNEL = "inferops:slo-targets:changed"
ACTIVATION_KEY = "inferops:activation"
ACTIVATION_CHANNEL = "inferops:activation:wanted"
ACTIVATION_REFRESH_S = 2.0
# What a parked deployment's routing entry says when its policy names no hold limits.
DEFAULT_HOLD_MAX_WAIT_S = 120.0
DEFAULT_HOLD_MAX_QUEUE = 100
SLO_TTFT_HEADER = "x-inferops-slo-ttft-ms"
SLO_TPOT_HEADER = "x-inferops-slo-tpot-ms"
USAGE_STREAM = "inferops:usage"
# Live gateways: instance -> JSON {instance, address (host:port), metrics_path, seen_at (Unix s)},
# refreshed every GATEWAY_HEARTBEAT_S; an entry older than GATEWAY_STALE_S is a dead gateway.
GATEWAYS_KEY = "inferops:gateways"
GATEWAY_HEARTBEAT_S = 10.0
GATEWAY_STALE_S = 35.0
# Gateways' rate-limit counters: `<prefix>:<key|tenant>:<name>:<rpm|tpm|conc>...`, shared by every gateway.
RATE_LIMIT_PREFIX = "inferops:rl"

# Error kinds of a usage event that are the platform's fault, whatever status the client saw.
SHED = "shed"  # refused before any replica: none ready, all saturated, or limits fail closed
UPSTREAM_CONNECT = "upstream_connect"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_ERROR = "upstream_error"
INTERNAL = "internal"
# Refused by a built-in replica under --slo-reject-late because it could no longer meet its TTFT
# target (a 503 with code SLO_LATE): shed by the engine, so it counts against the SLO like any shed.
LATE = "late"
SLO_LATE = "slo_late"
SERVER_ERROR_KINDS = (SHED, LATE, UPSTREAM_TIMEOUT, UPSTREAM_ERROR, UPSTREAM_CONNECT, INTERNAL)
# Refused on purpose by the deployment's degradation policy (a 503 with code `degraded`): neither
# good nor bad for an SLO, or shedding would keep the burn up that caused it.
DEGRADED = "degraded"


def is_server_failure(status: int, error_kind: str | None) -> bool:
    """The platform's fault (slo/sli.py says the same in SQL)."""
    return (status >= 500 and error_kind != DEGRADED) or error_kind in SERVER_ERROR_KINDS

# `<deployment>--preview`: a rollout's candidate alone, for smoke tests before it takes traffic.
PREVIEW_SUFFIX = "--preview"


def ttft_verdicts_key(deployment: str, minute: int) -> str:
    """The TTFT verdict counters of a deployment in one minute (Unix seconds // 60)."""
    return f"{TTFT_VERDICTS_PREFIX}:{deployment}:{minute}"


def slo_targets_field(deployment: str, tenant: str) -> str:
    return f"{deployment}:{tenant}"


def ttft_verdict_field(deadline_ms: float, second: int, good: bool) -> str:
    return f"{deadline_ms:g}:{second}:{'good' if good else 'bad'}"


def hash_api_key(secret: str) -> str:
    """How a key is found in KEYS_KEY: the full key is never stored or published."""
    return hashlib.sha256(secret.encode()).hexdigest()
