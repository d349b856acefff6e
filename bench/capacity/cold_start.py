"""Cold start of one replica, phase by phase, on the tiny and small demo models, against plain transformers.

inferops, the real path: a deployment on a fresh scratch database is scaled from 0 to 1 replica and reconciled
(`reconcile_deployment`: the local driver, the replica supervisor, `inferops serve`) every --pass-interval
seconds until its replica is ready; one completion of one token goes straight to the replica; the phases are
read from its `ReplicaStart` after `record_cold_start()`; then it is scaled back to 0 and reconciled until the
process is gone. Each start is timed from `started_at`, when the reconcile loop asked the driver for it.

The peer, in the same run and alternating with it: a fresh Python process that loads the same checkpoint with
transformers (`AutoTokenizer` and `AutoModelForCausalLM.from_pretrained`, float32) and `generate()`s one token
from the same prompt, at the same torch thread count; timed from just before the process is spawned. Its
phases: the process is up, the weights are loaded, the first token is out (no "ready": nothing serves).

Each model first gets one untimed start of each (the files reach the page cache, the engine's C kernels are
built once); the figures are the --runs after it: median and p90 of every phase, and transformers' median time
over inferops' for weights loaded and first token (above 1: inferops is faster).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python bench/capacity/cold_start.py --result-json bench/capacity/results/cold_start.json

Checkpoints come from bench/engine/work/{tiny,small} (written there with `inferops demo-model` when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "engine"))
from scratch import django_on_scratch_database, log, percentile, recreate_scratch_database  # noqa: E402
from serving_bench import MachineLoad, emit_report  # noqa: E402  (bench/engine/serving_bench.py)

SCRATCH_DB = "inferops_bench_cold_start"
WORK = REPO_ROOT / "bench" / "engine" / "work"
PROMPT = "Hello"
PHASES = ("process", "weights_loaded", "ready", "first_token")
PEER_PHASES = ("process", "weights_loaded", "first_token")

# The peer's whole life: its own start (to /proc/uptime's 10 ms, as the replica server reports its own), the
# moment from_pretrained returned, and the moment one generated token was out; printed as one JSON line.
PEER_SCRIPT = r"""
import json, os, sys, time
with open("/proc/self/stat") as f:
    ticks = float(f.read().split(")")[-1].split()[19])
with open("/proc/uptime") as f:
    process = time.time() - float(f.read().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(int(sys.argv[2]))
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
loaded = time.time()
with torch.inference_mode():
    out = model.generate(**tokenizer(sys.argv[3], return_tensors="pt"), max_new_tokens=1, do_sample=False)
first = time.time()
assert out.shape[1] >= 1
print(json.dumps({"process": process, "weights_loaded": loaded, "first_token": first}))
"""


def checkpoint(preset: str) -> Path:
    directory = WORK / preset
    if not (directory / "config.json").is_file():
        from runtime.engine.demo_model import write_demo_model

        log(f"writing the {preset} demo checkpoint to {directory}")
        write_demo_model(directory, preset=preset, seed=0)
    return directory


def peer_start(model_dir: Path, threads: int) -> dict[str, float]:
    began = time.time()
    done = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(model_dir), str(threads), PROMPT],
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the transformers peer failed:\n{done.stderr[-2000:]}")
    moments = json.loads(done.stdout.strip().splitlines()[-1])
    return {phase: round(moments[phase] - began, 3) for phase in PEER_PHASES}


class InferopsPath:
    """One deployment of one checkpoint, started from zero and parked again through reconcile passes."""

    def __init__(self, name: str, model_dir: Path, threads: int, pass_interval_s: float) -> None:
        from deployments import services as deployment_services
        from registry import services as registry_services

        model = registry_services.model_create(name=name, task="generate", actor=None)
        registry_services.version_register(model=model, artifact_uri=str(model_dir), actor=None)
        self.deployment = deployment_services.deployment_create(
            name=name, model=model, version=1, replicas=0, actor=None, engine_args={"cpu_threads": threads})
        self.pass_interval_s = pass_interval_s

    def passes_until(self, done, timeout_s: float, what: str):
        from deployments.replicas.reconcile import reconcile_deployment

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reconcile_deployment(self.deployment.pk)
            if found := done():
                return found
            time.sleep(self.pass_interval_s)
        raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def start(self) -> dict:
        import httpx

        from deployments.choices import ReplicaState
        from deployments.models import Deployment, Replica
        from deployments.replicas.cold_start import record_cold_start

        Deployment.objects.filter(pk=self.deployment.pk).update(replicas=1)
        replica = self.passes_until(
            lambda: Replica.objects.filter(deployment=self.deployment, state=ReplicaState.READY).first(),
            900, "the replica to become ready")
        response = httpx.post(f"{replica.url}/v1/completions", timeout=120, trust_env=False, json={
            "model": self.deployment.name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        response.raise_for_status()
        start = record_cold_start(replica)
        seconds = {phase: None if value is None else round(value, 3) for phase, value in start.seconds().items()}
        if None in seconds.values():
            raise SystemExit(f"a phase is missing: {seconds}")
        Deployment.objects.filter(pk=self.deployment.pk).update(replicas=0)
        self.passes_until(lambda: not Replica.objects.filter(deployment=self.deployment).exclude(
            state=ReplicaState.STOPPED).exists(), 120, "the replica to stop")
        return {"cause": start.cause, **seconds}

    def remove(self) -> None:
        from deployments.replicas import routing

        routing.unpublish(self.deployment.name)


def phase_figures(runs: list[dict], phases: tuple[str, ...]) -> dict:
    return {phase: {"median": round(percentile([r[phase] for r in runs], 50), 3),
                    "p90": round(percentile([r[phase] for r in runs], 90), 3),
                    "min": min(r[phase] for r in runs), "max": max(r[phase] for r in runs)} for phase in phases}


def measure(preset: str, runs: int, threads: int, pass_interval_s: float) -> dict:
    model_dir = checkpoint(preset)
    server = InferopsPath(f"cold-{preset}", model_dir, threads, pass_interval_s)
    try:
        log(f"{preset}: untimed first start of each")
        warmup = {"inferops": server.start(), "transformers": peer_start(model_dir, threads)}
        ours, peers = [], []
        with MachineLoad() as load:
            for index in range(runs):
                order = ("inferops", "transformers") if index % 2 == 0 else ("transformers", "inferops")
                for side in order:
                    if side == "inferops":
                        ours.append(server.start())
                    else:
                        peers.append(peer_start(model_dir, threads))
                log(f"{preset} run {index + 1}/{runs}: inferops {ours[-1]}, transformers {peers[-1]}")
    finally:
        server.remove()
    our_figures, peer_figures = phase_figures(ours, PHASES), phase_figures(peers, PEER_PHASES)
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "checkpoint": f"bench/engine/work/{preset}", "weight_bytes": (model_dir / "model.safetensors").stat().st_size,
        "layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "inferops": {"runs": ours, "figures": our_figures},
        "transformers": {"runs": peers, "figures": peer_figures},
        # Above 1: inferops is faster; "added_s": what the server adds to the peer's time (medians).
        "peer_over_inferops": {phase: round(peer_figures[phase]["median"] / our_figures[phase]["median"], 3)
                               for phase in ("weights_loaded", "first_token")},
        "added_s": {phase: round(our_figures[phase]["median"] - peer_figures[phase]["median"], 3)
                    for phase in ("process", "weights_loaded", "first_token")},
        "warmup": warmup, **load.fields(),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,small", help="demo presets, comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="timed starts of each, per model")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the replica and of the peer")
    parser.add_argument("--pass-interval", type=float, default=0.2,
                        help="seconds between reconcile passes (the worker's default is 2: it adds up to that "
                             "to ready and first token)")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="inferops-cold-start-")
    os.environ["INFEROPS_DATA_DIR"] = data_dir
    admin_url = django_on_scratch_database(SCRATCH_DB)
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", verbosity=0)

    from deployments import services as deployment_services

    # Parking between runs needs no wait for gateways (there are none); nothing else changes.
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0}
    deployment_services.request_reconcile = lambda deployment: None  # the passes are ours, not a worker's
    try:
        models = {preset: measure(preset, args.runs, args.threads, args.pass_interval)
                  for preset in args.models.split(",")}
    finally:
        from django.db import connections

        connections.close_all()
        recreate_scratch_database(admin_url, SCRATCH_DB, drop_only=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    emit_report({"benchmark": "cold_start", "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "commit": commit, "cpu": cpu_model(), "cpus": os.cpu_count(), "threads": args.threads,
                 "runs": args.runs, "pass_interval_s": args.pass_interval, "prompt": PROMPT, "models": models},
                args.result_json)


if __name__ == "__main__":
    main()
