"""What the prefix, memory, online, scoring and profile benchmarks share on top of serving_bench.py's helpers.

A run starts a server (`ServerSession`, on serving_bench's `RunningServer`), drives it with
`runtime.loadgen.run_benchmark`, and reads the replica's own counters from /metrics, the
server process's resident memory and the machine's load and CPU steal around the run
(`MachineLoad`).
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving_bench import (  # noqa: E402
    DEFAULT_MODEL_DIR,
    REPORTED,
    SERVED_NAME,
    MachineLoad,
    RunningServer,
    ServerSpec,
    add_run_arguments,
    benchmark_model,
    emit_report,
    load_average,
    port_is_free,
    server_specs,
    workload_report,
)

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark  # noqa: E402

__all__ = [
    "DEFAULT_MODEL_DIR",
    "REPORTED",
    "SERVED_NAME",
    "MachineLoad",
    "RssSampler",
    "RunningServer",
    "ServerSession",
    "ServerSpec",
    "add_run_arguments",
    "benchmark_model",
    "emit_report",
    "inferops_spec",
    "load_average",
    "metric_total",
    "port_is_free",
    "rss_bytes",
    "vllm_spec",
    "warm_up",
    "workload_report",
]


def inferops_spec(
    model_dir: Path, port: int, threads: int, extra: list[str], dtype: str = "float32"
) -> ServerSpec:
    """serving_bench's `inferops serve` command with explicit torch threads and extra flags."""
    spec = server_specs(model_dir, port, threads, dtype)[0]
    command = [*spec.command, "--cpu-threads", str(threads), *extra]
    return ServerSpec(spec.name, command, spec.env)


def vllm_spec(model_dir: Path, port: int, threads: int, dtype: str = "float32",
              preload: str = "docs") -> ServerSpec:
    return server_specs(model_dir, port, threads, dtype, preload)[1]


def metric_total(base_url: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in the server's Prometheus exposition."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def rss_bytes(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


class RssSampler:
    """Samples a process's VmRSS in a background thread; `peak` and `samples` after `stop`."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stopped.is_set():
            value = rss_bytes(self.pid)
            if value is not None:
                self.samples.append(value)
            self._stopped.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)


def warm_up(base_url: str, model_dir: Path) -> None:
    """Two short unshared requests, so lazy initialisation is not charged to the run."""
    config = BenchConfig(
        base_url=base_url,
        model=SERVED_NAME,
        num_prompts=2,
        input_len=LengthRange(32, 32),
        output_len=LengthRange(4, 4),
        tokenizer_dir=str(model_dir),
        seed=12345,
        show_progress=False,
    )
    run_benchmark(config)


class ServerSession:
    """Starts a server (its log in work/<log_name>.log), warms it up unless told not to, and stops it
    on exit; `base_url` is where it answers. RuntimeError when the port is taken or it does not come up."""

    def __init__(self, spec: ServerSpec, log_name: str, model_dir: Path, args: argparse.Namespace,
                 warm: bool = True):
        self.base_url = f"http://127.0.0.1:{args.port}"
        if not port_is_free(args.port):
            raise RuntimeError(f"port {args.port} is taken; pass --port")
        self.server = RunningServer(spec, HERE / "work" / f"{log_name}.log")
        self.model_dir = model_dir
        self.startup_timeout = args.startup_timeout
        self.warm = warm

    def __enter__(self) -> ServerSession:
        try:
            self.server.wait_ready(self.base_url, self.startup_timeout)
            if self.warm:
                warm_up(self.base_url, self.model_dir)
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.stop()
