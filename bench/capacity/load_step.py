"""Load step → a new replica serving: the per-deployment autoscaler against the global policy before it.

Every part runs for real on a scratch database and the Redis database of REDIS_URL (it must be
empty): a deployment of the tiny demo checkpoint (one replica, at most two, `max_num_seqs` 4),
started by the reconcile loop through the local process driver, and an `inferops gateway`. A
control thread does what beat does, at beat's default intervals: a scrape cycle every 15 s, a
reconcile pass every 2 s, and in the new arm an autoscaling tick every 5 s.

Each arm: a light load (one closed-loop client) until the replica is warm, then a step to
`--clients` closed-loop clients (four times what one replica runs at once, so requests queue).
Measured from the step: when the deployment asks for a second replica (the decision), when that
replica is ready (/health 200), and when it answers its first request (its own /metrics count a
finished request) — the figure the issue asks for.

- `global`: the policy the reconcile loop ran before issue 42, loaded as it was from git (commit
  GLOBAL_POLICY_COMMIT, deployments/replicas/autoscale.py), run before each reconcile pass as the
  loop ran it: scale up when every one of the last two complete minutes of scraped rows was
  overloaded (more than 2 waiting per replica, or KV above 85 %).
- `per-deployment`: capacity.scaling's tick with the default policy: the same two signals and
  thresholds, a 30 s stabilisation window, over samples the tick takes itself every 5 s.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/11 \\
        .venv/bin/python bench/capacity/load_step.py [--runs 2]

Writes bench/capacity/results/load-step-<date>.json (see bench/capacity/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from scratch import django_on_scratch_database, free_port, log, recreate_scratch_database, wait_for  # noqa: E402

GLOBAL_POLICY_COMMIT = "c29fc67"  # the last commit with the global policy in the reconcile loop
SCRAPE_S, RECONCILE_S, AUTOSCALE_S = 15.0, 2.0, 5.0  # beat's defaults (project/settings.py)
MAX_NUM_SEQS = 4


def global_policy():
    """deployments/replicas/autoscale.py as it was at GLOBAL_POLICY_COMMIT, imported as a module."""
    source = subprocess.run(["git", "show", f"{GLOBAL_POLICY_COMMIT}:deployments/replicas/autoscale.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "global_autoscale.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("global_autoscale", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["global_autoscale"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class ControlLoop(threading.Thread):
    """Beat, for one deployment: scrape, reconcile (the global arm's policy first), autoscale."""

    def __init__(self, deployment_id: int, arm: str):
        super().__init__(daemon=True)
        self.deployment_id, self.arm = deployment_id, arm
        self.stopping = threading.Event()
        self.legacy = global_policy() if arm == "global" else None

    def run(self) -> None:
        from django.db import connection
        from django.utils import timezone

        from capacity.scaling import autoscale
        from deployments.models import Deployment
        from deployments.replicas.reconcile import reconcile_deployment
        from deployments.replicas.scraping import scrape_cycle

        due = {"scrape": 0.0, "reconcile": 0.0, "autoscale": 0.0}
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= due["scrape"]:
                    scrape_cycle()
                    due["scrape"] = now + SCRAPE_S
                if now >= due["reconcile"]:
                    if self.legacy is not None:
                        self.legacy.autoscale(Deployment.objects.get(pk=self.deployment_id), timezone.now())
                    reconcile_deployment(self.deployment_id)
                    due["reconcile"] = now + RECONCILE_S
                if self.arm == "per-deployment" and now >= due["autoscale"]:
                    autoscale(self.deployment_id, held=set())
                    due["autoscale"] = now + AUTOSCALE_S
                self.stopping.wait(0.2)
        finally:
            connection.close()


class Clients:
    """`count` closed-loop clients through the gateway (non-streamed chat, 32 tokens out)."""

    def __init__(self, base: str, key: str, model: str):
        self.base, self.key, self.model = base, key, model
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.done = self.failed = 0

    def add(self, count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(target=self.loop, daemon=True)
            thread.start()
            self.threads.append(thread)

    def loop(self) -> None:
        body = {"model": self.model, "max_tokens": 32, "ignore_eos": True,
                "messages": [{"role": "user", "content": "tell me a long story about the sea"}]}
        with httpx.Client(timeout=120) as client:
            while not self.stopping.is_set():
                try:
                    ok = client.post(f"{self.base}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {self.key}"}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.done += ok
                self.failed += not ok
                if not ok:
                    time.sleep(0.2)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(130)


def finished_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def run_arm(arm: str, index: int, model, gateway: str, key: str, clients: int, warm_s: float) -> dict:
    from capacity.policy import AutoscalingPolicySerializer
    from capacity.scaling import policy_save
    from deployments.choices import ReplicaState
    from deployments.models import Deployment, Replica
    from deployments.services import deployment_create, deployment_delete

    name = f"step-{arm}-{index}"
    deployment = deployment_create(name=name, model=model, version=1, actor=None,
                                   engine_args={"max_num_seqs": MAX_NUM_SEQS, "cpu_threads": 1})
    if arm == "per-deployment":
        policy = AutoscalingPolicySerializer(data={"enabled": True, "min_replicas": 1, "max_replicas": 2},
                                  context={"deployment": deployment})
        policy.is_valid(raise_exception=True)
        policy_save(deployment=deployment, actor=None, data=policy.validated_data)
    else:
        Deployment.objects.filter(pk=deployment.pk).update(autoscale=True, min_replicas=1, max_replicas=2)
    loop = ControlLoop(deployment.pk, arm)
    loop.start()
    load = Clients(gateway, key, name)
    try:
        wait_for(lambda: Replica.objects.filter(deployment=deployment, state=ReplicaState.READY).exists(), 300,
                 f"{name}'s first replica", 1)
        first = Replica.objects.get(deployment=deployment, state=ReplicaState.READY)
        load.add(1)
        wait_for(lambda: load.done >= 3, 120, "the light load to be served", 0.5)
        time.sleep(warm_s)
        log(f"{arm} #{index}: step to {clients} clients")
        step = time.monotonic()
        load.add(clients - 1)
        decided = wait_for(lambda: Deployment.objects.get(pk=deployment.pk).replicas == 2 and time.monotonic(),
                           900, "the decision to scale up", 0.2)
        second = wait_for(lambda: Replica.objects.filter(deployment=deployment).exclude(pk=first.pk).first(),
                          60, "the second replica row", 0.2)
        ready = wait_for(lambda: Replica.objects.get(pk=second.pk).state == ReplicaState.READY and time.monotonic(),
                         300, "the second replica to be ready", 0.2)
        url = Replica.objects.get(pk=second.pk).url
        serving = wait_for(lambda: finished_requests(url) > 0 and time.monotonic(), 120,
                           "the second replica's first answer", 0.2)
        figures = {"arm": arm, "run": index, "decision_s": decided - step, "ready_s": ready - step,
                   "serving_s": serving - step, "served": load.done, "failed": load.failed}
        if arm == "per-deployment":  # the series the decision was taken on, for tests to replay
            from capacity.models import ScalingState

            figures["step_at"] = time.time() - (time.monotonic() - step)
            figures["samples"] = [{k: v for k, v in sample.items() if k != "raw"}
                                  for sample in ScalingState.objects.get(deployment=deployment).samples]
        log(f"{arm} #{index}: decided {figures['decision_s']:.1f} s, ready {figures['ready_s']:.1f} s, "
            f"serving {figures['serving_s']:.1f} s after the step")
        return figures
    finally:
        load.stop()
        loop.stopping.set()
        loop.join(30)
        deployment_delete(deployment=Deployment.objects.get(pk=deployment.pk), actor=None)
        from deployments.replicas.reconcile import reconcile_deployment

        wait_for(lambda: reconcile_deployment(deployment.pk) == "deleted", 120, f"{name} to be gone", 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each arm, alternating (default 2)")
    parser.add_argument("--clients", type=int, default=4 * MAX_NUM_SEQS, help="clients after the step")
    parser.add_argument("--warm-s", type=float, default=20, help="light load before the step (default 20 s)")
    parser.add_argument("--arms", nargs="+", default=["global", "per-deployment"], choices=["global", "per-deployment"])
    parser.add_argument("--out", default=None, help="results file (default results/load-step-<date>.json)")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="load-step-"))
    os.environ["INFEROPS_DATA_DIR"] = str(data_dir)
    admin_url = django_on_scratch_database("bench_load_step")
    gateway = None
    results: list[dict] = []
    try:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from registry.services import model_create, version_register
        from runtime.engine.demo_model import write_demo_model
        from tenants.publish import publish_keys
        from tenants.services import key_create, tenant_create

        model_dir = data_dir / "tiny"
        write_demo_model(model_dir, preset="tiny", seed=0)
        model = model_create(name="demo-tiny", task="generate", actor=None)
        version_register(model=model, artifact_uri=str(model_dir), actor=None)
        _, key = key_create(tenant=tenant_create(name="bench", actor=None), name="load", actor=None)
        publish_keys()
        port = free_port()
        gateway = subprocess.Popen(
            [sys.executable, "-m", "project.cli", "gateway", "--port", str(port), "--redis-url",
             os.environ["REDIS_URL"], "--spool-dir", str(data_dir / "spool"), "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, 30, "gateway /health")
        for index in range(args.runs):
            arms = args.arms if index % 2 == 0 else args.arms[::-1]
            for arm in arms:
                results.append(run_arm(arm, index, model, base, key, args.clients, args.warm_s))
    finally:
        if gateway is not None:
            os.killpg(gateway.pid, signal.SIGTERM)
        from deployments.models import Replica
        from deployments.replicas.drivers.local import LocalProcessDriver

        for replica in Replica.objects.all():
            LocalProcessDriver().kill(replica)
        from django.db import connections

        connections.close_all()
        recreate_scratch_database(admin_url, "bench_load_step", drop_only=True)
    summary = {}
    for arm in ("global", "per-deployment"):
        rows = [row for row in results if row["arm"] == arm]
        summary[arm] = {key: statistics.median(row[key] for row in rows)
                        for key in ("decision_s", "ready_s", "serving_s")} if rows else {}
    out = Path(args.out) if args.out else HERE / "results" / f"load-step-{datetime.now(UTC):%Y-%m-%d}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "runs": results,
                               "median": summary, "intervals_s": {"scrape": SCRAPE_S, "reconcile": RECONCILE_S,
                                                                  "autoscale": AUTOSCALE_S},
                               "global_policy_commit": GLOBAL_POLICY_COMMIT}, indent=2) + "\n")
    log(f"wrote {out}: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
