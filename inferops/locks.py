"""Postgres advisory locks: one holder at a time across every worker, released on exit.

Periodic tasks run at least once, sometimes twice (a beat tick while the last run still
works, a redelivered message); the ones that must not overlap take one of these and skip
their turn when another process holds it. A worker that dies loses its connection, and
Postgres releases the lock with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection


@contextmanager
def try_advisory_lock(namespace: int, key: int = 0) -> Iterator[bool]:
    """Yield whether this session now holds the lock (namespace, key); never waits."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [namespace, key])
        acquired = cursor.fetchone()[0]
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [namespace, key])
