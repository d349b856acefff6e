"""Workload A over HTTP: the built-in engine (`inferops serve`) against vLLM on the same checkpoint.

Each server in turn is started on the tiny demo checkpoint, warmed up with an untimed burst, loaded
`--rounds` times with the same seeded prompts through `runtime.loadgen.run_benchmark` (the code
behind `inferops bench`) and stopped; `--sessions` such sessions per server, alternating. The JSON
report holds every round's metrics, each server's median output throughput and the built-in
engine's as a ratio of vLLM's (of the medians, and round by round).

vLLM runs from its own virtualenv, bench/engine/.venv-vllm (make it with peers.sh); it is
skipped, with the reason recorded, when that venv is missing or the server does not come up.

    .venv/bin/python bench/engine/serving_bench.py --result-json bench/engine/work/serving.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from runtime.engine.demo_model import write_demo_model  # noqa: E402
from runtime.loadgen import BenchConfig, LengthRange, run_benchmark  # noqa: E402
from runtime.vllm_preload import vllm_cpu_preload  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = HERE / "work" / "tiny"


def benchmark_model(model_dir: Path | None) -> Path:
    """The checkpoint to benchmark: the one given, else the tiny demo (written on first use)."""
    model_dir = model_dir or DEFAULT_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, preset="tiny", seed=0)
    (HERE / "work").mkdir(exist_ok=True)
    return model_dir
VLLM_PYTHON = HERE / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "tiny"
REPORTED = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "errors",
)


def cpu_times() -> list[int]:
    """The machine's CPU time counters: /proc/stat's first line (user, nice, system, idle,
    iowait, irq, softirq, steal, ...), in clock ticks; empty where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            return [int(field) for field in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return []


STEAL = 7  # index of steal time in cpu_times()


class MachineLoad:
    """Load average and CPU steal around a measured run.

    Steal is time the hypervisor gave this VM's virtual CPUs to other guests, which the load
    average cannot see. A run with much of it ran on a slower machine: in the seventh round
    (bench/README.md) a prefix-cache round with 57 % steal had a TTFT median of 726 ms where
    the same settings gave 53-63 ms in five other rounds.
    """

    def __enter__(self) -> MachineLoad:
        self.load_before = load_average()
        self._cpu_before = cpu_times()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.load_after = load_average()
        self._cpu_after = cpu_times()

    @property
    def steal_share(self) -> float | None:
        """Share of all CPU time during the run that was stolen, 0..1 (None: not known)."""
        before, after = self._cpu_before, self._cpu_after
        if len(before) <= STEAL or len(after) != len(before):
            return None
        # guest time (fields 8 and 9) is already counted in user and nice
        total = sum(a - b for a, b in zip(after[:STEAL + 1], before[:STEAL + 1], strict=True))
        return round((after[STEAL] - before[STEAL]) / total, 4) if total > 0 else None

    def fields(self) -> dict:
        return {"load_average_before": self.load_before, "load_average_after": self.load_after,
                "cpu_steal_share": self.steal_share}


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


@dataclass
class ServerSpec:
    name: str
    command: list[str]
    env: dict[str, str]


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' dtype for every server (bfloat16 wants a CPU with "
                             "native bf16, AVX512-BF16 or AMX, to be worth measuring)")


def add_run_arguments(parser: argparse.ArgumentParser, *, port: int, seed: bool = True) -> None:
    """The options of every benchmark that starts a server: the checkpoint (default: the tiny demo),
    torch threads, the port, the prompts' seed, how long a server may take to come up, the report's path."""
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=port)
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--result-json", type=Path, default=None)


def workload_report(args: argparse.Namespace, model_dir: Path) -> dict:
    """A report's first fields: the options it ran with (less the report's path) and the checkpoint."""
    return {"workload": {key: value for key, value in vars(args).items() if key not in ("result_json", "model")},
            "model": str(model_dir)}


def add_vllm_preload_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-preload", choices=["docs", "none"], default="docs",
                        help="docs: start vLLM with the LD_PRELOAD its CPU install guide asks "
                             "for (tcmalloc, Intel OpenMP) as far as this machine has them; "
                             "none: as rounds 1-11 did")


def vllm_ld_preload(mode: str = "docs") -> str:
    """docs: what vLLM's CPU install guide puts in LD_PRELOAD, as the platform's local driver
    starts CPU vLLM replicas (runtime.vllm_preload.vllm_cpu_preload); none: nothing."""
    return "" if mode == "none" else vllm_cpu_preload(str(VLLM_PYTHON))


def server_specs(model_dir: Path, port: int, threads: int, dtype: str = "float32",
                 vllm_preload: str = "docs") -> list[ServerSpec]:
    threads_env = {"OMP_NUM_THREADS": str(threads)}
    preload = vllm_ld_preload(vllm_preload)
    # Both servers take vLLM's flags for these.
    served = ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", dtype]
    inferops = ServerSpec(
        "inferops",
        [sys.executable, "-m", "project.cli", "serve", *served, "--log-level", "warning"],
        threads_env,
    )
    vllm = ServerSpec(
        "vllm",
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", *served, "--enforce-eager",
         "--gpu-memory-utilization", "0.3"],
        # vLLM's CPU backend keeps one core for its front end by default; give its engine the
        # same cores the built-in engine gets.
        {
            **threads_env,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            **({"LD_PRELOAD": preload} if preload else {}),
        },
    )
    return [inferops, vllm]


class RunningServer:
    """A server subprocess in its own process group, stopped with the group on exit."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            spec.command,
            cwd=REPO_ROOT,
            env={**os.environ, **spec.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.process.returncode}")
            try:
                # /health turns 200 only once the model is loaded (on both servers).
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def workload_a(base_url: str, model_dir: Path, args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        model=SERVED_NAME,
        endpoint="completions",
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        input_len=LengthRange(args.input_len, args.input_len),
        output_len=LengthRange(args.output_len, args.output_len),
        tokenizer_dir=str(model_dir),
        goodput_slos_ms={"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        show_progress=False,
    )


def emit_report(report: dict, result_json: Path | None) -> None:
    """Print a benchmark's report as JSON and write it to `result_json` when given."""
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if result_json:
        result_json.parent.mkdir(parents=True, exist_ok=True)
        result_json.write_text(text + "\n")


def port_is_free(port: int) -> bool:
    """Nobody listens on the port. SO_REUSEADDR, as the servers bind: connections of the
    previous server still in TIME_WAIT must not count as taken."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_server(spec: ServerSpec, port: int, model_dir: Path, args: argparse.Namespace):
    """Start one server, wait for it and warm it up; (server, base_url) or {"skipped": why}."""
    if spec.name == "vllm" and not VLLM_PYTHON.is_file():
        return {"skipped": f"{VLLM_PYTHON} missing; run bench/engine/peers.sh"}
    base_url = f"http://127.0.0.1:{port}"
    if not port_is_free(port):
        # Otherwise the readiness probe could find someone else's server and bench that.
        return {"skipped": f"port {port} is taken; pass --port"}
    log_path = HERE / "work" / f"{spec.name}.log"
    server = RunningServer(spec, log_path)
    try:
        server.wait_ready(base_url, args.startup_timeout)
        # A short run, then one whole untimed burst of the workload (another seed): lazy
        # initialisation, first-touch page faults and per-shape kernels (oneDNN builds one per
        # GEMM shape, on both servers) are not charged to the measured rounds.
        warm_up = workload_a(base_url, model_dir, args)
        warm_up.num_prompts, warm_up.output_len = 2, LengthRange(4, 4)
        run_benchmark(warm_up)
        burst = workload_a(base_url, model_dir, args)
        burst.seed = args.seed + 1
        run_benchmark(burst)
    except RuntimeError as error:
        server.stop()
        return {"skipped": str(error), "log": str(log_path)}
    return server, base_url


def bench_servers(wanted: list[str], model_dir: Path, args: argparse.Namespace) -> dict:
    """`--sessions` sessions per server, alternating servers (A B A B ...), each session
    started, warmed up, measured `--rounds` times and stopped.

    Only one server is up at a time: an idle vLLM still wakes the CPU often enough to slow a
    server beside it on two cores by 20-30% (measured), so running both at once is not fair.
    Alternating sessions spreads drift in the machine's speed over both.
    """
    results: dict[str, dict] = {}
    rounds: dict[str, list[dict]] = {}
    for session in range(args.sessions):
        for name in wanted:
            if "skipped" in results.get(name, {}):
                continue
            spec = next(s for s in server_specs(model_dir, args.port, args.threads, args.dtype,
                                                args.vllm_preload)
                        if s.name == name)
            outcome = start_server(spec, args.port, model_dir, args)
            if isinstance(outcome, dict):
                results[name] = outcome
                continue
            server, base_url = outcome
            try:
                for round_number in range(args.rounds):
                    print(f"session {session + 1}, round {round_number + 1}: {name} ...",
                          file=sys.stderr)
                    # A new seed per round (the same for both servers): repeated prompts would
                    # be served from the prefix cache, and workload A is a cold burst.
                    config = workload_a(base_url, model_dir, args)
                    config.seed = args.seed + 100 + round_number
                    with MachineLoad() as machine:
                        metrics = run_benchmark(config)
                    rounds.setdefault(name, []).append(
                        {key: metrics[key] for key in REPORTED}
                        | {"session": session + 1} | machine.fields()
                    )
            finally:
                server.stop()
    for name, runs in rounds.items():
        results[name] = {
            "median_output_throughput": statistics.median(r["output_throughput"] for r in runs),
            "rounds": runs,
        }
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, port=8031)
    parser.add_argument("--servers", default="inferops,vllm")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    add_dtype_argument(parser)
    add_vllm_preload_argument(parser)
    # Workload A is greedy; these run it sampled (e.g. --temperature 0.7 --top-p 0.9).
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    # e.g. 1.05, what Qwen2.5's generation_config.json gives every request on both servers
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = benchmark_model(args.model)
    wanted = [name.strip() for name in args.servers.split(",")]
    results = bench_servers(wanted, model_dir, args)
    report = {**workload_report(args, model_dir), "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
              "servers": results}
    ours, peer = results.get("inferops", {}), results.get("vllm", {})
    if "rounds" in ours and "rounds" in peer:
        report["inferops_over_vllm_output_throughput"] = round(
            ours["median_output_throughput"] / peer["median_output_throughput"], 3
        )
        report["per_round_ratio"] = [
            round(a["output_throughput"] / b["output_throughput"], 3)
            for a, b in zip(ours["rounds"], peer["rounds"], strict=True)
        ]
    # Strict JSON has no Infinity; write an unlimited rate the way `inferops bench` takes it.
    if math.isinf(args.request_rate):
        report["workload"]["request_rate"] = "inf"
    emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
