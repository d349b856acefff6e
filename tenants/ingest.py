"""Usage ingestion: the gateways' Redis usage stream (runtime/gateway/contract.py) into the Postgres ledger.

Each batch read from the consumer group `ingest` goes into Postgres in ONE transaction:
1. the raw events, `INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING request_id`, so a
   replayed (spool), duplicated or redelivered event inserts nothing the second time;
2. only the events that step 1 inserted, aggregated in Python per minute × tenant × key ×
   deployment × version, added into `UsageMinute` by one `INSERT ... ON CONFLICT DO UPDATE SET
   x = x + EXCLUDED.x` (histograms merged by the SQL function tenants_add_counts);
3. the same new events through the usage pipeline's other folds (inferops/usage_pipeline.py): the SLO
   minutes and verdicts, costing's hourly usage. Nothing else reads the events again.
The batch is XACKed only after the commit. A consumer killed between the two never acks; its
entries stay pending and a later run claims them (XAUTOCLAIM, idle > 60 s) and redoes them,
which step 1 makes harmless. Entries that are not valid events are moved to the stream
`<usage stream>:rejected` and acked, so one bad entry cannot block the stream forever.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
from bisect import bisect_left
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psycopg
import redis
from django.conf import settings
from django.db import connection, transaction

from inferops import usage_pipeline
from inferops.redis_client import redis_client
from runtime.gateway.contract import USAGE_STREAM, is_server_failure

log = logging.getLogger(__name__)

STREAM_KEY = USAGE_STREAM
GROUP = "ingest"
REJECTED_KEY = f"{USAGE_STREAM}:rejected"
BATCH_SIZE = 2000
CLAIM_IDLE_MS = 60_000
# 20 log-spaced buckets per decade (12 % wide) from 1 ms to 1,000 s; slower goes to "+Inf".
LATENCY_BUCKETS_MS = tuple(round(10 ** (i / 20), 3) for i in range(0, 121))
LATENCY_LABELS = tuple(f"{upper:g}" for upper in LATENCY_BUCKETS_MS) + ("+Inf",)

INT4 = (-(2**31), 2**31 - 1)
INT8 = (-(2**63), 2**63 - 1)
INT2 = (-(2**15), 2**15 - 1)
# Column name -> (kind, required, bound): bound is max length for text, (low, high) for integers.
# `request_id` is the gateway's own id (the idempotency key); `client_request_id` the client's
# X-Request-Id when it sent a usable one. `ttft_source` says who measured ttft_ms/tpot_ms:
# "gateway" (a stream, timed at the proxy), "server" (a whole answer, from the replica's
# Server-Timing header), absent when nobody did (e.g. a vLLM replica's whole answer). `batch_id`
# marks a line of an offline batch (the contract's USAGE_STREAM says what that changes).
EVENT_FIELDS: dict[str, tuple[str, bool, object]] = {
    "request_id": ("text", True, 64),
    "client_request_id": ("text", False, 128),
    "time": ("float", True, None),
    "tenant": ("text", False, 63),
    "key_prefix": ("text", False, 8),
    "deployment": ("text", False, 63),
    "version": ("int", False, INT4),
    "replica": ("int", False, INT8),
    "failed_replica": ("int", False, INT8),
    "priority": ("int", False, INT4),
    "endpoint": ("text", True, 16),
    "stream": ("bool", False, None),
    "prompt_tokens": ("int", False, INT4),
    "completion_tokens": ("int", False, INT4),
    "ttft_ms": ("float", False, None),
    "tpot_ms": ("float", False, None),
    "ttft_source": ("text", False, 16),
    "e2e_ms": ("float", True, None),
    "status": ("int", True, INT2),
    "finish_reason": ("text", False, 32),
    "error_kind": ("text", False, 32),
    "retries": ("int", False, INT2),
    "batch_id": ("text", False, 64),
}
COLUMNS = tuple(EVENT_FIELDS)
_FIELD_SPECS = tuple((name, *spec) for name, spec in EVENT_FIELDS.items())
FLOAT_MAX = sys.float_info.max
# Defaults for absent optional fields, as the columns store them.
DEFAULTS = {"priority": 0, "stream": False, "prompt_tokens": 0, "completion_tokens": 0, "retries": 0}
SQL_TYPES = {"text": "varchar", "float": "float8", "int": "int8", "bool": "bool"}


class InvalidEvent(ValueError):
    pass


def latency_bucket(ms: float) -> str:
    """The label of the smallest bucket whose upper bound is >= ms."""
    return LATENCY_LABELS[bisect_left(LATENCY_BUCKETS_MS, ms)]


def histogram_quantile(buckets: dict[str, int], q: float) -> float | None:
    """The q-quantile (0..1) of a latency histogram: the upper bound of the bucket that holds it."""
    total = sum(buckets.values())
    if not total:
        return None
    rank, seen = q * total, 0
    for label in LATENCY_LABELS:
        seen += buckets.get(label, 0)
        if seen >= rank and seen:
            return math.inf if label == "+Inf" else float(label)
    return math.inf


def parse_event(raw: bytes | str) -> dict:
    """Decode and check one stream entry; raises InvalidEvent naming the bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidEvent(f"not JSON: {exc}") from None
    if type(data) is not dict:
        raise InvalidEvent("not a JSON object")
    event = {}
    # `type(v) is int` rather than isinstance: JSON gives exact types, and it keeps True out of
    # integer fields. This loop runs per field per event: the consumer's hottest Python.
    for name, kind, required, bound in _FIELD_SPECS:
        value = data.get(name)
        if value is None:
            if required:
                raise InvalidEvent(f"{name}: missing")
            event[name] = DEFAULTS.get(name)
            continue
        value_type = type(value)
        if kind == "text":
            # Postgres text cannot hold NUL: one such value would fail its whole batch forever.
            if value_type is not str or not value or len(value) > bound or "\x00" in value:
                raise InvalidEvent(f"{name}: expected a string of 1-{bound} characters (no NUL)")
        elif kind == "float":
            if value_type is int:
                value = float(value)  # JSON may say 272 for 272.0; a batch's column must have one type
            elif value_type is not float:
                raise InvalidEvent(f"{name}: expected a finite number >= 0")
            if not 0 <= value <= FLOAT_MAX:  # also false for NaN
                raise InvalidEvent(f"{name}: expected a finite number >= 0")
        elif kind == "int":
            if value_type is not int or not bound[0] <= value <= bound[1]:
                raise InvalidEvent(f"{name}: expected an integer")
        elif value_type is not bool:
            raise InvalidEvent(f"{name}: expected true or false")
        event[name] = value
    return event


@dataclass
class MinuteTotals:
    requests: int = 0
    errors: int = 0
    client_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_sum_ms: float = 0.0
    ttft_count: int = 0
    tpot_sum_ms: float = 0.0
    tpot_count: int = 0
    e2e_sum_ms: float = 0.0
    e2e_count: int = 0
    ttft_buckets: dict = field(default_factory=dict)
    tpot_buckets: dict = field(default_factory=dict)
    e2e_buckets: dict = field(default_factory=dict)
    # Lines of offline batches: also in the counters above (they are usage), and only there.
    batch_requests: int = 0
    batch_errors: int = 0
    batch_prompt_tokens: int = 0
    batch_completion_tokens: int = 0

    def add(self, event: dict) -> None:
        status = event["status"]
        self.requests += 1
        failed = is_server_failure(status, event["error_kind"])
        if failed:
            self.errors += 1
        elif status >= 400:
            self.client_errors += 1
        prompt, completion = event["prompt_tokens"], event["completion_tokens"]
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        # .get: events built by hand (tests, benchmarks) may predate the field.
        if event.get("batch_id") is not None:
            self.batch_requests += 1
            self.batch_errors += failed
            self.batch_prompt_tokens += prompt
            self.batch_completion_tokens += completion
            return  # the latency roll-ups are the interactive traffic's: a batch line waits on purpose
        if status >= 400:
            return  # latency roll-ups describe what successful requests experienced
        # Spelled out rather than looped over names: this runs once per event on the hot path.
        if (ttft := event["ttft_ms"]) is not None:
            self.ttft_sum_ms += ttft
            self.ttft_count += 1
            count_into(self.ttft_buckets, ttft)
        if (tpot := event["tpot_ms"]) is not None:
            self.tpot_sum_ms += tpot
            self.tpot_count += 1
            count_into(self.tpot_buckets, tpot)
        e2e = event["e2e_ms"]
        self.e2e_sum_ms += e2e
        self.e2e_count += 1
        count_into(self.e2e_buckets, e2e)


def count_into(buckets: dict, ms: float) -> None:
    label = LATENCY_LABELS[bisect_left(LATENCY_BUCKETS_MS, ms)]
    buckets[label] = buckets.get(label, 0) + 1


def aggregate(events: Iterable[dict]) -> dict[tuple, MinuteTotals]:
    """Events -> totals per (minute epoch, tenant, key prefix, deployment, version)."""
    minutes: dict[tuple, MinuteTotals] = {}
    for event in events:
        identity = (int(event["time"] // 60) * 60, event["tenant"], event["key_prefix"],
                    event["deployment"], event["version"])
        totals = minutes.get(identity)
        if totals is None:
            totals = minutes[identity] = MinuteTotals()
        totals.add(event)
    return minutes


_INSERT_EVENTS = (
    f"INSERT INTO tenants_usageevent ({', '.join(COLUMNS)}, ingested_at) "
    f"SELECT {', '.join('to_timestamp(time)' if c == 'time' else c for c in COLUMNS)}, now() FROM unnest("
    + ", ".join(f"%b::{SQL_TYPES[EVENT_FIELDS[c][0]]}[]" for c in COLUMNS)
    + f") AS batch({', '.join(COLUMNS)}) ON CONFLICT (request_id) DO NOTHING RETURNING request_id"
)
_COUNTERS = [f.name for f in MinuteTotals.__dataclass_fields__.values() if not f.name.endswith("_buckets")]
_HISTOGRAMS = [f.name for f in MinuteTotals.__dataclass_fields__.values() if f.name.endswith("_buckets")]
_IDENTITY_TYPES = {"minute": "float8", "tenant": "varchar", "key_prefix": "varchar", "deployment": "varchar",
                   "version": "int8"}
_MINUTE_COLUMNS = [*_IDENTITY_TYPES, *_COUNTERS, *_HISTOGRAMS]
_UPSERT_MINUTES = (
    f"INSERT INTO tenants_usageminute ({', '.join(_MINUTE_COLUMNS)}) "
    f"SELECT {', '.join('to_timestamp(minute)' if c == 'minute' else c for c in _MINUTE_COLUMNS)} FROM unnest("
    + ", ".join(
        [f"%b::{sql}[]" for sql in _IDENTITY_TYPES.values()]
        + [f"%b::{'float8' if c.endswith('_ms') else 'int8'}[]" for c in _COUNTERS]
        + ["%b::text[]::jsonb[]" for _ in _HISTOGRAMS]
    )
    + f") AS batch({', '.join(_MINUTE_COLUMNS)}) ON CONFLICT ON CONSTRAINT usage_minute_identity DO UPDATE SET "
    + ", ".join([f"{c} = tenants_usageminute.{c} + EXCLUDED.{c}" for c in _COUNTERS]
                + [f"{c} = tenants_add_counts(tenants_usageminute.{c}, EXCLUDED.{c})" for c in _HISTOGRAMS])
)


def store_events(events: list[dict]) -> int:
    """Write a batch of parsed events and their minute roll-ups in one transaction.

    Returns how many events were new; events whose request id is already stored add nothing. An
    optional field an event lacks (one from an older gateway, or built by hand) is stored as
    parse_event would default it.
    """
    if not events:
        return 0
    # A plain psycopg cursor on Django's connection, inside its transaction: Django's own cursor
    # binds parameters client-side, escaping every array element in Python (the consumer's
    # largest CPU cost); this one sends the arrays as binary parameters (the %b placeholders).
    with transaction.atomic(), psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(_INSERT_EVENTS, [[event.get(c, DEFAULTS.get(c)) for event in events] for c in COLUMNS])
        inserted = {row[0] for row in cursor.fetchall()}
        # A request id repeated inside the batch is inserted once; count it once too.
        fresh, seen = [], set()
        for event in events:
            request_id = event["request_id"]
            if request_id in inserted and request_id not in seen:
                seen.add(request_id)
                fresh.append(event)
        minutes = aggregate(fresh)
        # Sorted so that concurrent consumers lock ledger rows in one order and never deadlock.
        identities = sorted(minutes, key=lambda k: tuple("" if v is None else str(v) for v in k))
        if identities:
            columns = [[identity[i] for identity in identities] for i in range(len(_IDENTITY_TYPES))]
            columns += [[getattr(minutes[k], c) for k in identities] for c in _COUNTERS]
            columns += [[json.dumps(getattr(minutes[k], c)) for k in identities] for c in _HISTOGRAMS]
            cursor.execute(_UPSERT_MINUTES, columns)
        usage_pipeline.fold(cursor, fresh)
    return len(fresh)


@dataclass
class IngestReport:
    read: int = 0
    inserted: int = 0
    claimed: int = 0
    rejected: int = 0
    batches: int = 0

    @property
    def duplicates(self) -> int:
        return self.read - self.inserted - self.rejected


def parse_entries(entries: list[tuple]) -> tuple[list[dict], list[tuple]]:
    """Stream entries -> (valid events, [(entry id, fields, reason)] for the invalid ones)."""
    events, rejected = [], []
    for entry_id, fields in entries:
        try:
            events.append(parse_event(fields.get(b"e", fields.get("e"))))
        except InvalidEvent as exc:
            rejected.append((entry_id, fields, str(exc)))
    return events, rejected


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis) -> None:
    try:
        # From "0": events the gateway wrote before any consumer existed are ingested too.
        client.xgroup_create(STREAM_KEY, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def forget_idle_consumers(client: redis.Redis, idle_ms: int = 24 * 3600 * 1000) -> list[str]:
    """Remove consumers with nothing pending that have been idle that long.

    Each worker process joins the group under its own hostname-pid, so restarts leave names
    behind. One with pending entries stays: deleting a consumer drops its pending entries from
    the group, and they would never be claimed and redone.
    """
    try:
        consumers = client.xinfo_consumers(STREAM_KEY, GROUP)
    except redis.ResponseError:  # no stream or no group yet
        return []
    forgotten = []
    for consumer in consumers:
        name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
        if consumer["pending"] == 0 and consumer["idle"] >= idle_ms:
            client.xgroup_delconsumer(STREAM_KEY, GROUP, name)
            forgotten.append(name)
    return forgotten


class UsageIngestor:
    """Reads batches from the consumer group and stores them; one instance per run."""

    def __init__(self, client: redis.Redis | None = None, consumer: str | None = None,
                 batch_size: int = BATCH_SIZE, claim_idle_ms: int = CLAIM_IDLE_MS):
        self.client = client or redis_client()
        self.consumer = consumer or consumer_name()
        self.batch_size = batch_size
        self.claim_idle_ms = claim_idle_ms
        self.report = IngestReport()

    def run(self, budget_s: float | None = None) -> IngestReport:
        """Redo stale pending entries, then drain new ones until empty or the budget is spent.

        While one batch is written to Postgres, a reader thread already fetches and parses the
        next: the database works while Python decodes, which on two cores is most of the gain.
        """
        budget_s = settings.INFEROPS_USAGE_INGEST_BUDGET_S if budget_s is None else budget_s
        deadline = time.monotonic() + budget_s
        ensure_group(self.client)
        self.claim_from_this_host(deadline)
        self.claim_stale(deadline)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-reader") as reader:
            upcoming = reader.submit(self.read_new)
            while upcoming is not None:
                entries, events, rejected = upcoming.result()
                if not entries:
                    break
                upcoming = reader.submit(self.read_new) if time.monotonic() < deadline else None
                # If storing fails, the batch read ahead stays pending too and is claimed later.
                self.store(entries, events, rejected)
        return self.report

    def read_new(self) -> tuple[list, list[dict], list[tuple]]:
        reply = self.client.xreadgroup(GROUP, self.consumer, {STREAM_KEY: ">"}, count=self.batch_size)
        entries = reply[0][1] if reply else []
        return (entries, *parse_entries(entries))

    def claim_from_this_host(self, deadline: float) -> None:
        """Redo at once what a consumer of this host read and did not acknowledge: its store failed
        (the database was down) or its process died. One run per host at a time (the task's lock), so
        none is at them now; another host's wait for CLAIM_IDLE_MS. A redone event counts once."""
        host = socket.gethostname()
        for consumer in self.client.xinfo_consumers(STREAM_KEY, GROUP):
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if not consumer["pending"] or name.rsplit("-", 1)[0] != host:
                continue
            while time.monotonic() < deadline:
                pending = self.client.xpending_range(STREAM_KEY, GROUP, min="-", max="+", count=self.batch_size,
                                                     consumername=name)
                if not pending:
                    break
                claimed = self.client.xclaim(STREAM_KEY, GROUP, self.consumer, 0,
                                             [entry["message_id"] for entry in pending])
                entries = [entry for entry in claimed if entry and entry[1] is not None]
                if not entries:  # deleted meanwhile: XCLAIM drops them from the pending list
                    break
                self.report.claimed += len(entries)
                self.store(entries, *parse_entries(entries))

    def claim_stale(self, deadline: float) -> None:
        start = "0-0"
        while time.monotonic() < deadline:
            reply = self.client.xautoclaim(STREAM_KEY, GROUP, self.consumer, self.claim_idle_ms,
                                           start_id=start, count=self.batch_size)
            start, entries = reply[0], [entry for entry in reply[1] if entry and entry[1] is not None]
            if entries:
                self.report.claimed += len(entries)
                self.store(entries, *parse_entries(entries))
            if start in (b"0-0", "0-0"):
                return

    def store(self, entries: list[tuple], events: list[dict], rejected: list[tuple]) -> None:
        inserted = store_events(events)  # commits, or raises and leaves the batch pending
        if rejected:
            self.reject(rejected)
        ids = [entry_id for entry_id, _ in entries]
        # Deleted once acknowledged: the ledger has them, nothing else reads the stream, and kept
        # they would fill Redis's memory up to the gateways' MAXLEN (a million events).
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(STREAM_KEY, GROUP, *ids)
            pipe.xdel(STREAM_KEY, *ids)
            pipe.execute()
        self.report.read += len(entries)
        self.report.inserted += inserted
        self.report.rejected += len(rejected)
        self.report.batches += 1

    def reject(self, rejected: list[tuple]) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for entry_id, fields, reason in rejected:
                raw = fields.get(b"e", fields.get("e")) or b""
                pipe.xadd(REJECTED_KEY, {"id": entry_id, "e": raw, "reason": reason}, maxlen=100_000, approximate=True)
            pipe.execute()
        log.warning("usage ingestion: %d invalid stream entries moved to %s (first: %s)",
                    len(rejected), REJECTED_KEY, rejected[0][2])


def ingest_usage(*, budget_s: float | None = None, consumer: str | None = None) -> IngestReport:
    return UsageIngestor(consumer=consumer).run(budget_s)
