"""Where `inferops serve` spends its time under workload A: py-spy samples, grouped by cause.

The server is started on the tiny demo checkpoint and sent a long enough burst of workload-A
requests (32 at once, 64-token prompts, 64 output tokens, `--bursts` times in a row); meanwhile py-spy (from a scratch
virtualenv, never the project's: `python -m venv /tmp/pyspy-venv && /tmp/pyspy-venv/bin/pip install
py-spy`) records the server process for `--seconds` with all its threads. Each sample's stack is
put in the first matching category (innermost project frame decides), and the report gives each
category's share of the engine thread's samples and of all samples.

    .venv/bin/python bench/engine/profile_bench.py --py-spy /tmp/pyspy-venv/bin/py-spy \\
        --result-json bench/engine/results/profile_A.json
"""

from __future__ import annotations

import argparse
import collections
import linecache
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import engine_runs as shared

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

# (category, (function name or "*", path fragment) pairs), checked from the innermost frame
# outwards; the first frame that matches any category names the sample. Frames from torch's own
# Python files match nothing, so a sample is charged to the project code that called torch.
MODEL = "runtime/engine/model.py"
RUNNER = "runtime/engine/model_runner.py"
CATEGORIES: list[tuple[str, tuple[tuple[str, str], ...]]] = [
    ("idle: thread blocked on a queue or lock", (("wait", "threading.py"), ("get", "queue.py"))),
    ("attention (KV gather, SDPA, cache writes)", (("paged_attention", MODEL),)),
    ("attention metadata (block tables, masks)", (("_decode_metadata", RUNNER), ("_prefill_metadata", RUNNER))),
    ("rotary, norms, activations", (("rms_norm", MODEL), ("rotate_half", MODEL), ("lookup", MODEL))),
    ("forward body: q/k/v, o, MLP matmuls + residuals, SiLU", (("forward", MODEL),)),
    ("logits (final norm + LM head)", (("compute_logits", MODEL),)),
    ("batch preparation (token/slot lists)", (("prepare", RUNNER), ("execute", RUNNER))),
    ("sampling", (("*", "runtime/engine/sampling.py"),)),
    ("detokenization", (("*", "runtime/engine/tokenizer.py"), ("*", "tokenizers"))),
    ("scheduling and block manager", (("*", "runtime/engine/scheduler.py"), ("*", "runtime/engine/block_manager.py"),
                                      ("*", "runtime/engine/sequence.py"))),
    ("engine bookkeeping (outputs, metrics)", (("*", "runtime/engine/engine.py"), ("*", "runtime/engine/metrics.py"))),
    ("engine thread hand-off (async engine)", (("*", "runtime/engine/async_engine.py"),)),
    ("HTTP, SSE and JSON (server, starlette, uvicorn)", (
        ("*", "runtime/engine/server/"), ("*", "runtime/engine/openai_protocol.py"), ("*", "starlette"),
        ("*", "uvicorn"), ("*", "h11"), ("*", "httptools"), ("*", "json"),
    )),
    ("asyncio event loop", (("*", "asyncio"),)),
]
ENGINE_THREAD = "model-loop"  # the thread async_engine.py runs LLMEngine.step in
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>.*?)(?::\d+)?\)$")


def names(function: str, wanted: str) -> bool:
    # py-spy writes qualified names ("CausalLM.forward").
    return wanted == "*" or function == wanted or function.endswith("." + wanted)


def hot_line(frames: list[str]) -> str | None:
    """The innermost frame in the project's own code, as "path:line"."""
    for frame in reversed(frames):
        if frame.split(" (", 1)[-1].startswith(("runtime/", "inferops/")):
            return frame.split(" (", 1)[-1].rstrip(")")
    return None


def source_of(location: str) -> str:
    path, _, line = location.rpartition(":")
    return linecache.getline(str(REPO_ROOT / path), int(line)).strip()


def categorise(frames: list[str]) -> str:
    for frame in reversed(frames):
        match = FRAME.match(frame)
        if match is None:
            continue
        function, path = match["function"], match["path"]
        for name, patterns in CATEGORIES:
            if any(fragment in path and names(function, wanted) for wanted, fragment in patterns):
                return name
    return "other"


def read_collapsed(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy's raw format: `thread;frame;frame... count` per line, outermost frame first."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        stacks.append((thread, frames, int(count)))
    return stacks


def summarise(stacks: list[tuple[str, list[str], int]]) -> dict:
    by_category: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    engine_categories: collections.Counter[str] = collections.Counter()
    engine_lines: collections.Counter[str] = collections.Counter()
    for thread, frames, count in stacks:
        category = categorise(frames)
        by_category[category] += count
        by_thread[thread] += count
        if ENGINE_THREAD in thread:
            engine_categories[category] += count
            location = hot_line(frames)
            if location is not None:
                engine_lines[location] += count
    total = sum(by_category.values()) or 1
    engine_total = sum(engine_categories.values()) or 1
    return {
        "samples": sum(by_category.values()),
        "share_of_all_samples": {k: round(v / total, 3) for k, v in by_category.most_common()},
        "engine_thread_samples": sum(engine_categories.values()),
        "share_of_engine_thread_samples": {
            k: round(v / engine_total, 3) for k, v in engine_categories.most_common()
        },
        "engine_thread_hot_lines": [
            {"at": location, "share": round(count / engine_total, 3), "source": source_of(location)}
            for location, count in engine_lines.most_common(15)
        ],
        "samples_by_thread": dict(by_thread.most_common()),
    }


def burst(base_url: str, model_dir: Path, num_prompts: int, workload: str = "A") -> BenchConfig:
    """Workload A's requests, or workload B's mix (32-512 + 256-token shared prefix for 30 %,
    16-256 out), all sent at once."""
    config = BenchConfig(
        base_url=base_url,
        model=shared.SERVED_NAME,
        num_prompts=num_prompts,
        input_len=LengthRange(64, 64),
        output_len=LengthRange(64, 64),
        tokenizer_dir=str(model_dir),
        show_progress=False,
    )
    if workload == "B":
        config.input_len, config.output_len = LengthRange(32, 512), LengthRange(16, 256)
        config.shared_prefix_len, config.shared_prefix_ratio = 256, 0.3
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8035, seed=False)
    parser.add_argument("--py-spy", default="/tmp/pyspy-venv/bin/py-spy")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--workload", choices=("A", "B"), default="A")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--bursts", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = shared.benchmark_model(args.model)
    if not shared.port_is_free(args.port):
        print(f"port {args.port} is taken; pass --port", file=sys.stderr)
        return 1
    if shutil.which(args.py_spy) is None:  # a path, or a name on PATH
        print(f"no py-spy at {args.py_spy}: python3 -m venv /tmp/pyspy-venv && "
              "/tmp/pyspy-venv/bin/pip install py-spy, or pass --py-spy", file=sys.stderr)
        return 1
    raw_path = HERE / "work" / f"profile_{args.workload}.txt"
    spec = shared.inferops_spec(model_dir, args.port, args.threads, [])
    with shared.ServerSession(spec, "profile", model_dir, args, warm=False) as session:
        run_benchmark(burst(session.base_url, model_dir, 2))
        workload = burst(session.base_url, model_dir, args.num_prompts, args.workload)
        throughputs: list[float] = []

        def bursts() -> None:
            # Workload A again and again, so the engine is busy for the whole recording.
            for _ in range(args.bursts):
                throughputs.append(run_benchmark(workload)["output_throughput"])

        load = threading.Thread(target=bursts)
        load.start()
        spy = [args.py_spy, "record", "--pid", str(session.server.process.pid), "--duration", str(args.seconds),
               "--format", "raw", "--output", str(raw_path), "--threads", "--nonblocking"]
        with shared.MachineLoad() as machine:
            subprocess.run(spy, check=True, capture_output=True)
        load.join()
    report = {
        "workload": {
            "name": args.workload, "num_prompts": args.num_prompts, "bursts": args.bursts,
            "input_len": f"{workload.input_len.low}-{workload.input_len.high}",
            "output_len": f"{workload.output_len.low}-{workload.output_len.high}",
            "shared_prefix_len": workload.shared_prefix_len, "threads": args.threads,
        },
        "profile_seconds": args.seconds,
        **machine.fields(),
        "output_throughput_per_burst": [round(value, 1) for value in throughputs],
        **summarise(read_collapsed(raw_path)),
    }
    shared.emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
