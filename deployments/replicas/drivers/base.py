"""What every replica driver offers the reconcile loop.

A driver turns a Replica row into a running server and back. The reconcile loop owns the rows
and their states; a driver only acts and observes:

- `start(replica, spec) -> Started`: launch without waiting for readiness; returns where it
  will listen and how to find it again (identity) — never blocks on model loading.
- `is_alive(replica) -> bool`: does the process / pod still exist (not: is it ready).
- `stop(replica, grace_s, why)`: ask it to drain (SIGTERM / pod deletion with a grace period).
- `kill(replica, why)`: stop it now. `why` goes to the worker's log and the replica's.
- `exit_status(replica) -> str`: how a replica that is no longer alive ended, for its last error.
- `log_tail(replica, lines) -> str`: the last lines of its log, for the console.

Readiness is the same for every driver: GET {url}/health answers 200 (deployments.replicas.reconcile.probe_health).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything needed to run one replica of a deployment version."""

    deployment: str          # route name; also the served model name
    version: int             # registry version number
    model_path: str          # local checkpoint directory (from the version's artifact_uri)
    backend: str             # "builtin" | "vllm"
    engine_args: dict = field(default_factory=dict)   # CLI options in snake case
    resources: dict = field(default_factory=dict)     # gpu_type, gpu_count, cpu, memory

    @property
    def run_args(self) -> dict:
        """engine_args as the replica runs with them: a built-in replica given a GPU runs on it
        unless its engine_args name a device (gpus.builtin_device_error refuses a contradiction)."""
        if self.backend == "builtin" and self.resources.get("gpu_count") and "device" not in self.engine_args:
            return {**self.engine_args, "device": "cuda"}
        return self.engine_args


@dataclass(frozen=True)
class Started:
    url: str
    port: int | None
    identity: dict
    log_path: str = ""


class DriverError(RuntimeError):
    """The driver could not act (no free port, binary missing, API refused); retried with backoff."""


class NoCapacity(DriverError):
    """Nothing is wrong but the node lacks room now (free GPUs): the replica waits, pending."""
