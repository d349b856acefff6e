"""Publish the active API keys to Redis for the gateways (see the gateway contract).

KEYS_KEY is a hash: field = sha256 hex of the full key, value = JSON with the key's
prefix, tenant, scope, priority, expiry and both levels of limits. Every publish replaces the
whole hash in one MULTI/EXEC (DEL + HSET), so a gateway never reads a half-written table, then
bumps the keys' generation and announces on their channel (runtime/gateway/contract.py).

Publishers are serialised by a Postgres advisory lock held while the snapshot is read and
written: without it, a publisher that read the table just before a revoke committed could
write its stale snapshot after the revoke's own publish and bring the key back for up to 30 s.
"""

from __future__ import annotations

import json
import logging

import redis
from django.db import transaction
from django.utils import timezone

from inferops.locks import LockId, advisory_xact_lock
from inferops.redis_client import replace_table
from runtime.gateway.contract import KEYS_CHANNEL, KEYS_GENERATION_KEY, KEYS_KEY
from tenants.models import ApiKey

log = logging.getLogger(__name__)



def key_entry(key: ApiKey) -> dict:
    return {
        "prefix": key.prefix,
        "name": key.name,
        "tenant": key.tenant.name,
        "deployments": list(key.deployments),
        "priority": key.priority,
        "expires_at": key.expires_at.timestamp() if key.expires_at else None,
        "limits": {"key": key.limits(), "tenant": key.tenant.limits()},
    }


def snapshot(now=None) -> dict[str, str]:
    """The whole published table: key hash -> JSON entry, for active, unexpired keys."""
    keys = ApiKey.objects.active(now or timezone.now()).select_related("tenant").order_by("pk")
    return {key.key_hash: json.dumps(key_entry(key), separators=(",", ":")) for key in keys}


def publish_keys() -> int:
    """Replace the published key table with the database's; returns how many keys it holds."""
    with transaction.atomic():
        advisory_xact_lock(LockId.KEYS_PUBLISH)
        table = snapshot()
        replace_table(KEYS_KEY, KEYS_GENERATION_KEY, KEYS_CHANNEL, table, "keys")
    return len(table)


def publish_keys_quietly() -> None:
    """After a commit: publish now; if Redis is unreachable, the 30-s beat republishes later.

    The database change already committed, so an error here must not turn a successful API
    call into a 500.
    """
    try:
        publish_keys()
    except redis.RedisError as exc:
        log.warning("publishing API keys to Redis failed (%s); the beat task retries within 30 s", exc)


def publish_on_commit() -> None:
    transaction.on_commit(publish_keys_quietly)
