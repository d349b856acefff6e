"""Postgres advisory locks: one holder at a time across every worker, released on exit.

Periodic tasks run at least once, sometimes twice (a beat tick while the last run still
works, a redelivered message); the ones that must not overlap take one of these and skip
their turn when another process holds it. A worker that dies loses its connection, and
Postgres releases the lock with it. Advisory locks belong to one database, so two
installations on one Postgres server never block each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum

from django.db import connection


class LockId(IntEnum):
    """The first key of every advisory lock (the second is an object's id, or 0), in one table so
    that no two jobs share a lock by accident. Values fit Postgres' int4."""

    RECONCILE = 4242  # one deployment's reconcile pass; the second key is its id
    SLO_EVALUATION = 0x510E  # the evaluation cycle, and SLO deletes that must not interleave with it
    SCRAPE = 0x73637261  # "scra": one scrape cycle at a time
    KEYS_PUBLISH = 0x696F706B  # "iopk": publishing the API key table
    COSTING_LEDGER = 0x636F7374  # "cost": the ledger sync; key 2 a month close, key 3 price-book writes
    AUTOSCALE = 0x61757473  # "auts": one deployment's autoscaling decision; the second key is its id
    WAKE = 0x77616B65  # "wake": starting one parked deployment for held requests; the second key is its id


@contextmanager
def try_advisory_lock(namespace: LockId, key: int = 0) -> Iterator[bool]:
    """Yield whether this session now holds the lock (namespace, key); never waits."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [int(namespace), key])
        acquired = cursor.fetchone()[0]
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [int(namespace), key])


def advisory_xact_lock(namespace: LockId, key: int = 0) -> None:
    """Wait for the lock (namespace, key) and hold it until the current transaction ends."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [int(namespace), key])
