"""Eval runs on the tiny demo model: how long a 200-case set takes, against lm-evaluation-harness on
the same cases and replica, and what an eval run beside interactive traffic costs that traffic.

Every part runs for real on a scratch database and the Redis database of REDIS_URL: the tiny demo
checkpoint registered, a deployment of it whose one replica the reconcile loop starts through the
local process driver, and two eval sets uploaded through the services:

- `choice`: 200 cases, a prompt of 12-24 words and 4 continuations of 1-6 words each;
- `exact`: 200 cases, a prompt of 12-24 words, greedy output up to 8 tokens against an expected string.

1. Timing. Each set is scored by an eval run on the deployment (`run_create`, then the task's body
   `execute_run` in this process, as the worker would), `--concurrency` cases at a time, and the same
   cases are scored by lm-evaluation-harness 0.4.13 (`local-completions` on the same replica: token-id
   loglikelihood requests for `choice`, `generate_until` with exact_match for `exact`), with
   `num_concurrent` = `--concurrency`. Reported: seconds from start to the last case, and the scores
   of both (the choice scores must agree).
2. Interference. The replica's saturation rate (a closed loop of `--saturation-concurrency` streamed
   chat clients straight to the replica), then twice the same seeded open-loop Poisson run at
   `--load` x that rate for `--duration` s: alone, and with eval runs (the choice set, then the exact
   set, again while the load lasts) beside it at the lowest priority, which the engine runs as
   background work (`--no-background` starts the replica without that class, for comparison).
   Reported: the interactive requests' TTFT p50/p99 in each run and the ratio (target: p99 within 10 %).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/12 \\
        .venv/bin/python bench/evals/bench_evals.py

Writes bench/evals/results-<date>.json (see bench/evals/README.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from scratch import django_on_scratch_database, log, recreate_scratch_database, wait_for  # noqa: E402

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark  # noqa: E402

DEPLOYMENT = "evals-tiny"
DATABASE = "bench_evals"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases in each set (default 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="cases at a time, both sides (default 8)")
    parser.add_argument("--duration", type=float, default=60, help="seconds of interactive load a run (default 60)")
    parser.add_argument("--load", type=float, default=0.6, help="offered rate / saturation rate (default 0.6)")
    parser.add_argument("--saturation-concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64, help="interactive prompt words (default 64)")
    parser.add_argument("--output-len", type=int, default=32, help="interactive output tokens (default 32)")
    parser.add_argument("--replica-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-peer", action="store_true", help="leave lm-evaluation-harness out")
    parser.add_argument("--no-background", action="store_true",
                        help="start the replica with --no-background-priority (eval requests compete for whole steps)")
    parser.add_argument("--result-json", type=Path, default=None)
    return parser.parse_args()


def words() -> list[str]:
    """Plain lower-case words of the demo model's WordPiece vocabulary."""
    from runtime.engine.encoder import find_packaged_minilm

    vocab = (find_packaged_minilm() / "vocab.txt").read_text(encoding="utf-8").split()
    return [w for w in vocab[2000:] if w.isascii() and w.isalpha() and len(w) > 2][:5000]


def make_sets(count: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    vocabulary = words()

    def phrase(low: int, high: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(low, high)))

    choice = [{"id": f"choice-{i}", "prompt": phrase(12, 24),
               "choices": [" " + phrase(1, 6) for _ in range(4)], "answer": rng.randrange(4)}
              for i in range(count)]
    exact = [{"id": f"exact-{i}", "prompt": phrase(12, 24), "max_tokens": 8, "expected": phrase(1, 3)}
             for i in range(count)]
    return {"choice": choice, "exact": exact}


class Platform:
    """The tiny model registered and deployed on one replica, the sets uploaded."""

    def __init__(self, args: argparse.Namespace, model_dir: Path):
        self.args, self.model_dir = args, model_dir
        self.deployment = None
        self.replica_url = ""
        self.sets = {}

    def start(self, cases: dict[str, list[dict]]) -> None:
        from deployments.choices import ReplicaState
        from deployments.models import Replica
        from deployments.replicas.reconcile import reconcile_deployment
        from deployments.services import deployment_create
        from evals.sets.services import evalset_create, version_upload
        from registry.services import model_create, version_register

        model = model_create(name="demo-tiny", task="generate", actor=None)
        version_register(model=model, artifact_uri=str(self.model_dir), actor=None)
        self.deployment = deployment_create(name=DEPLOYMENT, model=model, version=1, actor=None,
                                            engine_args={"cpu_threads": self.args.replica_threads,
                                                         **({"no_background_priority": True}
                                                            if self.args.no_background else {})})

        def ready() -> bool:
            reconcile_deployment(self.deployment.pk)
            return Replica.objects.filter(deployment=self.deployment, state=ReplicaState.READY).exists()

        log("starting the replica (reconcile loop, local process driver) ...")
        wait_for(ready, 300, "the replica to be ready", interval_s=1)
        self.replica_url = Replica.objects.get(deployment=self.deployment, state=ReplicaState.READY).url
        for scorer, items in cases.items():
            eval_set = evalset_create(name=f"bench-{scorer}", scorer=scorer, actor=None)
            raw = "".join(json.dumps(case) + "\n" for case in items).encode()
            version_upload(eval_set=eval_set, raw=raw, actor=None)
            self.sets[scorer] = eval_set

    def stop(self) -> None:
        from deployments.models import Replica
        from deployments.replicas.drivers.local import LocalProcessDriver

        for replica in Replica.objects.all():
            LocalProcessDriver().kill(replica)


def eval_run(platform_: Platform, scorer: str, concurrency: int) -> dict:
    """One eval run on the deployment, worked in this process as the worker works it."""
    from evals.models import EvalRun
    from evals.runs.runner import execute_run
    from evals.runs.services import run_create

    run = run_create(eval_set=platform_.sets[scorer], actor=None, target={"deployment": DEPLOYMENT},
                     concurrency=concurrency)
    started = time.perf_counter()
    execute_run(run.pk)
    seconds = time.perf_counter() - started
    run = EvalRun.objects.get(pk=run.pk)
    if run.status != "succeeded":
        raise SystemExit(f"eval run {run.pk} {run.status}: {run.error}")
    figures = run.scores[scorer]
    return {"seconds": round(seconds, 2), "cases": run.total, "status": run.status, "score": run.score,
            **{key: figures[key] for key in ("acc", "acc_norm") if key in figures},
            "latency_ms": run.latency_ms, "prompt_tokens": run.prompt_tokens,
            "completion_tokens": run.completion_tokens}


LM_EVAL_TASKS = {
    "choice": """\
        output_type: multiple_choice
        doc_to_text: prompt
        doc_to_choice: choices
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
          - metric: acc_norm
        """,
    "exact": """\
        output_type: generate_until
        doc_to_text: prompt
        doc_to_target: expected
        target_delimiter: ""
        generation_kwargs:
          until: []
          max_gen_toks: 8
          do_sample: false
          temperature: 0
        filter_list:
          - name: strip
            filter:
              - function: regex
                regex_pattern: "(?s)^\\\\s*(.*?)\\\\s*$"
              - function: take_first
        metric_list:
          - metric: exact_match
        """,
}


def lm_eval_peer(platform_: Platform, scorer: str, cases: list[dict], concurrency: int) -> dict:
    """The same cases through lm-evaluation-harness against the same replica, in a process of its own."""
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        data = directory / "cases.jsonl"
        data.write_text("".join(json.dumps(case) + "\n" for case in cases))
        task = f"bench_{scorer}"
        (directory / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {directory / 'cache'}\ntest_split: test\n" + textwrap.dedent(LM_EVAL_TASKS[scorer]))
        script = textwrap.dedent(f"""\
            import json, time
            from lm_eval import simple_evaluate
            from lm_eval.tasks import TaskManager
            started = time.perf_counter()
            out = simple_evaluate(
                model="local-completions",
                model_args={{"model": {DEPLOYMENT!r}, "base_url": {platform_.replica_url + '/v1/completions'!r},
                            "tokenizer": {str(platform_.model_dir)!r}, "tokenizer_backend": "huggingface",
                            "tokenized_requests": True, "num_concurrent": {concurrency}, "max_retries": 1}},
                tasks=[{task!r}], task_manager=TaskManager(include_path={str(directory)!r}, include_defaults=False),
                num_fewshot=0, batch_size=1, bootstrap_iters=0)
            print("RESULT " + json.dumps({{"seconds": time.perf_counter() - started,
                                          "results": out["results"][{task!r}]}}))
            """)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"lm-eval failed:\n{done.stderr[-3000:]}")
        result = json.loads(line.removeprefix("RESULT "))
    # Keys read "acc,none" or "exact_match,strip" (metric, filter).
    metrics = {key.split(",")[0]: value for key, value in result["results"].items()
               if "," in key and "stderr" not in key}
    return {"seconds": round(result["seconds"], 2), **metrics}


def load(config: BenchConfig) -> dict:
    """run_benchmark in a process of its own, so this one's Python never delays its clock."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_benchmark, config).result()


def load_config(platform_: Platform, args: argparse.Namespace, **fields) -> BenchConfig:
    settings = dict(base_url=platform_.replica_url, model=DEPLOYMENT, endpoint="chat",
                    input_len=LengthRange(args.input_len, args.input_len),
                    output_len=LengthRange(args.output_len, args.output_len), seed=args.seed,
                    show_progress=False, timeout_s=120)
    settings.update(fields)
    return BenchConfig(**settings)


class EvalsBeside(threading.Thread):
    """Eval runs one after another (choice, exact, choice, ...) until stopped, at the lowest priority."""

    def __init__(self, platform_: Platform, concurrency: int):
        super().__init__(daemon=True)
        self.platform, self.concurrency = platform_, concurrency
        self.halt = threading.Event()
        self.runs: list[dict] = []

    def run(self) -> None:
        from django.db import connection

        try:
            for scorer in ("choice", "exact") * 100:
                if self.halt.is_set():
                    return
                self.runs.append({"scorer": scorer, **eval_run(self.platform, scorer, self.concurrency)})
        finally:
            connection.close()


def ttft_figures(metrics: dict) -> dict:
    return {"completed": metrics["completed"], "failed": metrics["failed"],
            "ttft_ms_p50": round(metrics["median_ttft_ms"], 1), "ttft_ms_p99": round(metrics["p99_ttft_ms"], 1),
            "tpot_ms_p50": round(metrics["median_tpot_ms"], 1), "request_throughput": round(
                metrics["request_throughput"], 3)}


def interference(platform_: Platform, args: argparse.Namespace) -> dict:
    closed = dict(num_prompts=4 * args.saturation_concurrency, max_concurrency=args.saturation_concurrency)
    log("warm-up ...")
    load(load_config(platform_, args, **closed, seed=args.seed + 1))
    saturation = load(load_config(platform_, args, **closed, seed=args.seed + 2))
    rate = args.load * saturation["request_throughput"]
    log(f"saturation {saturation['request_throughput']:.2f} req/s; offered {rate:.2f} req/s for {args.duration:.0f} s")
    open_loop = dict(num_prompts=max(10, round(rate * args.duration)), request_rate=rate, seed=args.seed + 3)
    alone = load(load_config(platform_, args, **open_loop))
    log(f"alone: TTFT p99 {alone['p99_ttft_ms']:.0f} ms")
    beside = EvalsBeside(platform_, args.concurrency)
    beside.start()
    time.sleep(2)  # the first eval run's cases are in flight before the load starts
    try:
        with_evals = load(load_config(platform_, args, **open_loop))
    finally:
        beside.halt.set()
        beside.join()
    log(f"with evals beside: TTFT p99 {with_evals['p99_ttft_ms']:.0f} ms ({len(beside.runs)} eval runs)")
    return {"saturation_rps": round(saturation["request_throughput"], 3), "offered_rps": round(rate, 3),
            "alone": ttft_figures(alone), "with_evals": ttft_figures(with_evals),
            "eval_runs_beside": beside.runs,
            "ttft_p99_ratio": round(with_evals["p99_ttft_ms"] / alone["p99_ttft_ms"], 3)}


def ensure_checkpoint() -> Path:
    model_dir = HERE / "work" / "tiny"
    if not (model_dir / "config.json").is_file():
        from runtime.engine.demo_model import write_demo_model

        log(f"writing the tiny demo checkpoint to {model_dir} ...")
        write_demo_model(model_dir, preset="tiny", seed=0)
    return model_dir


def main() -> int:
    args = parse_args()
    os.environ.setdefault("INFEROPS_DATA_DIR", tempfile.mkdtemp(prefix="bench-evals-"))
    admin_url = django_on_scratch_database(DATABASE)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    model_dir = ensure_checkpoint()
    cases = make_sets(args.cases, args.seed)
    platform_ = Platform(args, model_dir)
    results: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()}}
    try:
        platform_.start(cases)
        eval_run(platform_, "choice", args.concurrency)  # warm-up: the replica meets its shapes once
        for scorer in ("choice", "exact"):
            ours = eval_run(platform_, scorer, args.concurrency)
            log(f"{scorer}: inferops {ours['seconds']:.1f} s, score {ours['score']:.3f}")
            results[scorer] = {"inferops": ours}
            if not args.skip_peer:
                peer = lm_eval_peer(platform_, scorer, cases[scorer], args.concurrency)
                log(f"{scorer}: lm-evaluation-harness {peer['seconds']:.1f} s, {peer}")
                results[scorer]["lm_eval"] = peer
        results["interference"] = interference(platform_, args)
        results["machine"]["load_average_end"] = os.getloadavg()
    finally:
        platform_.stop()
        from django.db import connections

        connections.close_all()
        recreate_scratch_database(admin_url, DATABASE, drop_only=True)
    target = args.result_json or HERE / f"results-{datetime.now(UTC):%Y-%m-%d}.json"
    target.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {target}")
    print(json.dumps({k: results[k] for k in ("choice", "exact")}, indent=2))
    print(json.dumps({k: v for k, v in results["interference"].items() if k != "eval_runs_beside"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
