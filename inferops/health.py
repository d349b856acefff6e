"""Liveness facts the console shows: is the database up, when did a worker last run a task."""

from __future__ import annotations

import time

import redis
from django.db import connection
from django.db.utils import Error as DatabaseError

from inferops.redis_client import redis_client

HEARTBEAT_KEY = "inferops:worker:heartbeat"
HEARTBEAT_STALE_AFTER_S = 90
# Which installation's workers use this Redis database, renewed by every heartbeat. Two
# installations on one Redis database would share Celery's queues and the gateway's routes and
# keys (a task of one run against the other's database), so each needs a database of its own.
INSTALLATION_KEY = "inferops:installation"
INSTALLATION_CLAIM_S = 3 * HEARTBEAT_STALE_AFTER_S


def record_worker_heartbeat(now: float) -> None:
    redis_client(timeout_s=2).set(HEARTBEAT_KEY, now, ex=3600)


def claim_redis(installation: str) -> str | None:
    """Mark this Redis database as this installation's for a while; returns the other
    installation's id when a live one holds it already."""
    client = redis_client(timeout_s=2)
    client.set(INSTALLATION_KEY, installation, nx=True, ex=INSTALLATION_CLAIM_S)
    holder = (client.get(INSTALLATION_KEY) or b"").decode()
    if holder == installation:
        client.expire(INSTALLATION_KEY, INSTALLATION_CLAIM_S)
        return None
    return holder or None


def redis_owner(client: redis.Redis) -> str | None:
    """Another installation that uses this Redis database, if one does."""
    from inferops.models import installation_id

    holder = (client.get(INSTALLATION_KEY) or b"").decode()
    return holder if holder and holder != installation_id() else None


def status() -> dict:
    facts = {"database": "ok", "redis": "ok", "worker": "unknown", "worker_seen_s_ago": None}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError:
        facts["database"] = "unavailable"
    try:
        client = redis_client(timeout_s=2)
        seen = client.get(HEARTBEAT_KEY)
        shared_with = redis_owner(client) if facts["database"] == "ok" else None
    except redis.RedisError:
        facts["redis"] = "unavailable"
        return facts
    if shared_with:
        facts["redis"] = "shared"
        facts["redis_problem"] = (f"this Redis database is also used by inferops installation {shared_with}: "
                                  f"give each installation its own (REDIS_URL=redis://host:6379/<n>)")
    if seen is not None:
        age = time.time() - float(seen)
        facts["worker_seen_s_ago"] = round(age)
        facts["worker"] = "ok" if age < HEARTBEAT_STALE_AFTER_S else "stale"
    return facts
