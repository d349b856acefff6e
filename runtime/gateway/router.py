"""Which replica serves a request: version by traffic weight, then replica by load and affinity.

Load is this instance's count of outstanding requests per replica (no shared state on the hot
path; several gateways behind a balancer each see a fair share). Prefix affinity: the first
characters of the prompt pick a preferred replica by rendezvous hashing, which moves only the
prompts of a replica that joins or leaves; the preferred replica is used while its load stays
within `affinity_slack` of the least loaded one, so its prefix cache hits without hot spots.
A replica with repeated failures is ejected for a cool-off; if every candidate is ejected they
are tried anyway (a guess beats a certain 503).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from dataclasses import dataclass, field

from runtime.gateway.state import Replica, Route, Version

AFFINITY_CHARS = 256


class NoReplica(Exception):
    """Nothing ready serves this deployment (or every one was tried already)."""


class Saturated(Exception):
    """Every replica is at its cap of outstanding requests: shed instead of queueing."""


@dataclass
class ReplicaLoad:
    outstanding: int = 0
    failures: deque[float] = field(default_factory=deque)
    ejected_until: float = 0.0


@dataclass(frozen=True)
class Choice:
    version: int
    replica: Replica


class Router:
    def __init__(self, max_outstanding_per_replica: int = 64, affinity_slack: int = 4,
                 failure_threshold: int = 3, failure_window_s: float = 10.0, ejection_s: float = 15.0) -> None:
        self.max_outstanding = max_outstanding_per_replica
        self.affinity_slack = affinity_slack
        self.failure_threshold = failure_threshold
        self.failure_window_s = failure_window_s
        self.ejection_s = ejection_s
        self.loads: dict[str, ReplicaLoad] = {}
        self.ejections = 0

    def load(self, replica: Replica) -> ReplicaLoad:
        load = self.loads.get(replica.url)
        if load is None:
            load = self.loads[replica.url] = ReplicaLoad()
        return load

    def choose(self, route: Route, affinity_key: str, exclude: set[str]) -> Choice:
        """Raises NoReplica or Saturated. `exclude`: URLs this request already tried."""
        now = time.monotonic()
        candidates = [(v, [r for r in v.replicas if r.url not in exclude]) for v in route.versions if v.weight > 0]
        candidates = [(v, replicas) for v, replicas in candidates if replicas]
        if not candidates:
            raise NoReplica()
        healthy = [(v, [r for r in replicas if self.load(r).ejected_until <= now]) for v, replicas in candidates]
        healthy = [(v, replicas) for v, replicas in healthy if replicas]
        pool = healthy or candidates
        open_pool = [(v, [r for r in replicas if self.load(r).outstanding < self.max_outstanding])
                     for v, replicas in pool]
        open_pool = [(v, replicas) for v, replicas in open_pool if replicas]
        if not open_pool:
            raise Saturated()
        version, replicas = self._pick_version(open_pool)
        return Choice(version.number, self._pick_replica(replicas, affinity_key))

    @staticmethod
    def _pick_version(pool: list[tuple[Version, list[Replica]]]) -> tuple[Version, list[Replica]]:
        if len(pool) == 1:
            return pool[0]
        return random.choices(pool, weights=[v.weight for v, _ in pool])[0]

    def _pick_replica(self, replicas: list[Replica], affinity_key: str) -> Replica:
        if len(replicas) == 1:
            return replicas[0]
        least = min(self.load(r).outstanding for r in replicas)
        if affinity_key:
            preferred = max(replicas, key=lambda r: _rendezvous_score(affinity_key, r))
            if self.load(preferred).outstanding <= least + self.affinity_slack:
                return preferred
        return random.choice([r for r in replicas if self.load(r).outstanding == least])

    def snapshot(self) -> dict[str, tuple[int, bool]]:
        """URL -> (outstanding, ejected now), for metrics."""
        now = time.monotonic()
        return {url: (load.outstanding, load.ejected_until > now) for url, load in self.loads.items()}

    def started(self, replica: Replica) -> None:
        self.load(replica).outstanding += 1

    def finished(self, replica: Replica) -> None:
        self.load(replica).outstanding -= 1

    def record_failure(self, replica: Replica) -> bool:
        """Counts a connection error or 5xx; True when this one ejected the replica."""
        load = self.load(replica)
        now = time.monotonic()
        load.failures.append(now)
        while load.failures and load.failures[0] < now - self.failure_window_s:
            load.failures.popleft()
        if len(load.failures) >= self.failure_threshold and load.ejected_until <= now:
            load.ejected_until = now + self.ejection_s
            load.failures.clear()
            self.ejections += 1
            return True
        return False


def _rendezvous_score(key: str, replica: Replica) -> bytes:
    return hashlib.blake2b(f"{replica.id}\x00{key}".encode(), digest_size=8).digest()


def affinity_key(body: dict) -> str:
    """The first characters of the prompt (or of the first messages) that identify its prefix."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            text = content if isinstance(content, str) else repr(content)
            parts.append(text)
            size += len(text)
            if size >= AFFINITY_CHARS:
                break
        return "\x1e".join(parts)[:AFFINITY_CHARS]
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt[:64]
    return prompt[:AFFINITY_CHARS] if isinstance(prompt, str) else repr(prompt)[:AFFINITY_CHARS]
