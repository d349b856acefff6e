"""Liveness facts the console shows: is the database up, when did a worker last run a task."""

from __future__ import annotations

import time

import redis
from django.conf import settings
from django.db import connection
from django.db.utils import Error as DatabaseError

HEARTBEAT_KEY = "inferops:worker:heartbeat"
HEARTBEAT_STALE_AFTER_S = 90


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def record_worker_heartbeat(now: float) -> None:
    redis_client().set(HEARTBEAT_KEY, now, ex=3600)


def status() -> dict:
    facts = {"database": "ok", "redis": "ok", "worker": "unknown", "worker_seen_s_ago": None}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError:
        facts["database"] = "unavailable"
    try:
        seen = redis_client().get(HEARTBEAT_KEY)
    except redis.RedisError:
        facts["redis"] = "unavailable"
        return facts
    if seen is not None:
        age = time.time() - float(seen)
        facts["worker_seen_s_ago"] = round(age)
        facts["worker"] = "ok" if age < HEARTBEAT_STALE_AFTER_S else "stale"
    return facts
