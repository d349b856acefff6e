"""Graceful degradation under overload: does a policy keep the high-priority class inside its SLO?

Every part runs for real on a scratch database and the Redis database of REDIS_URL (it must be
empty): one replica of the built-in engine on the small demo checkpoint, started by the reconcile
loop through the local process driver; an `inferops gateway` process; two API keys of one tenant,
priority 9 (`high`) and 1 (`low`); a TTFT latency SLO on the deployment. A control thread does
what beat does, only faster: every `--cycle-s` it ingests the usage stream, runs
`slo.tasks.evaluation_cycle` (the task's body: the evaluation, then the degradation engine, which
publishes a level change to the gateways at once) and a reconcile pass (which publishes the level
in the routing table too). The load generator runs in a process of its own.

1. Warm-up: the saturation loop below, untimed (a cold replica runs 2-4x slower while it meets
   new batch and prompt shapes).
2. Saturation: a closed loop of `--saturation-concurrency` clients (the replica's max_num_seqs)
   through the gateway; its completed requests a second are the saturation rate.
   Then the unloaded TTFT (sequential requests through the gateway): the SLO's threshold is
   `--ttft-multiple` times its median.
3. Two open-loop Poisson runs at `--overload` times that rate, 20 % `high` and 80 % `low`
   requests (streaming chat, fixed lengths), `--duration` seconds each, the same seeded
   requests: (a) with no degradation policy, (b) with a policy whose level 1 sheds below
   priority 5. Run (b) starts at the top of a minute, with nothing of run (a) in its window.

Reports per run the high class's TTFT SLO attainment (failed requests count as misses), its
TTFT percentiles, goodput overall and per class, the low class's share shed with 503 `degraded`,
and for (b) how long the policy took to act (load start to level 1 decided, published, and the
first `degraded` answer) and to recover (end of the offered load to level 0 for good).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/11 \\
        .venv/bin/python bench/degradation/bench_degradation.py [--duration 90]

Writes bench/degradation/results-<date>.json (see bench/degradation/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from scratch import django_on_scratch_database, recreate_scratch_database, wait_for  # noqa: E402  (bench/scratch.py)

from runtime.loadgen import BenchConfig, LengthRange, RequestClass, run_benchmark  # noqa: E402

DEPLOYMENT = "chat"
PRIORITIES = {"high": 9, "low": 1}
SHED_BELOW = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=90, help="seconds of offered load per run (default 90)")
    parser.add_argument("--overload", type=float, default=2.0, help="offered rate / saturation rate (default 2)")
    parser.add_argument("--high-share", type=float, default=0.2, help="share of high-priority requests (default 0.2)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt words (default 64)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens (default 32)")
    parser.add_argument("--ttft-multiple", type=float, default=4.0,
                        help="SLO threshold = this x the unloaded TTFT median (default 4)")
    parser.add_argument("--objective", type=float, default=0.95)
    parser.add_argument("--min-requests", type=int, default=10, help="the SLO's min_requests (default 10)")
    parser.add_argument("--window-minutes", type=int, default=1, help="the policy's window (default 1)")
    parser.add_argument("--hold-s", type=int, default=20, help="the policy's hold time (default 20)")
    parser.add_argument("--enter-burn-rate", type=float, default=4.0, help="level 1's entry burn rate (default 4)")
    parser.add_argument("--exit-burn-rate", type=float, default=1.0, help="level 1's exit burn rate (default 1)")
    parser.add_argument("--cycle-s", type=float, default=2.0, help="seconds between control cycles (default 2)")
    parser.add_argument("--saturation-concurrency", type=int, default=64)
    parser.add_argument("--saturation-requests", type=int, default=192)
    parser.add_argument("--warmup-requests", type=int, default=128)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"], help="demo checkpoint (default small)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="checkpoint folder (default bench/degradation/work/<preset>, written when missing)")
    parser.add_argument("--replica-threads", type=int, default=2, help="the replica's torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", default="inferops_bench_degradation", help="scratch database (dropped after)")
    parser.add_argument("--result-json", type=Path, default=None)
    return parser.parse_args()


# ------------------------------------------------------------------ the platform's pieces


def machine_load():
    """bench/engine's load average and CPU steal around a run (imported late: it loads torch, which
    the load generator's process, importing this module, does not need)."""
    sys.path.insert(0, str(HERE.parent / "engine"))
    from serving_bench import MachineLoad

    return MachineLoad()


class Platform:
    """The deployment, its replica, two keys and a gateway, made through the platform's services."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, redis_url: str):
        self.args, self.model_dir, self.redis_url = args, model_dir, redis_url
        self.gateway: subprocess.Popen | None = None
        self.base_url = ""
        self.keys: dict[str, str] = {}
        self.deployment = None
        self.replica_pid, self.replica_url = 0, ""

    def start(self) -> None:
        from deployments.choices import ReplicaState
        from deployments.models import Replica
        from deployments.replicas.drivers.local import free_port
        from deployments.replicas.reconcile import reconcile_deployment
        from deployments.services import deployment_create
        from registry.services import model_create, version_register
        from tenants.publish import publish_keys
        from tenants.services import key_create, tenant_create

        model = model_create(name=f"demo-{self.args.preset}", task="generate", actor=None)
        version_register(model=model, artifact_uri=str(self.model_dir), actor=None)
        self.deployment = deployment_create(name=DEPLOYMENT, model=model, version=1, actor=None,
                                            engine_args={"cpu_threads": self.args.replica_threads})
        tenant = tenant_create(name="acme", actor=None)
        for name, priority in PRIORITIES.items():
            _, self.keys[name] = key_create(tenant=tenant, name=name, priority=priority, actor=None)
        publish_keys()

        def ready() -> bool:
            reconcile_deployment(self.deployment.pk)
            return Replica.objects.filter(deployment=self.deployment, state=ReplicaState.READY).exists()

        print("starting the replica (reconcile loop, local process driver) ...", flush=True)
        wait_for(ready, 300, "the replica to be ready", interval_s=1)
        replica = Replica.objects.get(deployment=self.deployment, state=ReplicaState.READY)
        self.replica_pid, self.replica_url = replica.identity["pid"], replica.url
        port = free_port("127.0.0.1")
        spool = Path(os.environ["INFEROPS_DATA_DIR"]) / "gateway-spool"
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "project.cli", "gateway", "--port", str(port), "--redis-url", self.redis_url,
             "--spool-dir", str(spool), "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200, 30, "gateway /health")
        for key in self.keys.values():
            wait_for(lambda key=key: httpx.get(f"{self.base_url}/v1/models", timeout=2,
                                               headers={"Authorization": f"Bearer {key}"}).json()["data"],
                     30, "the gateway to learn the keys and the route")

    def stop(self) -> None:
        from deployments.models import Replica
        from deployments.replicas.drivers.local import LocalProcessDriver

        if self.gateway is not None and self.gateway.poll() is None:
            os.killpg(self.gateway.pid, signal.SIGTERM)
            try:
                self.gateway.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.gateway.pid, signal.SIGKILL)
        for replica in Replica.objects.all():
            LocalProcessDriver().kill(replica)

    def replica_restarts(self) -> int:
        from deployments.models import Replica

        return Replica.objects.filter(deployment=self.deployment).count() - 1


class ControlLoop(threading.Thread):
    """Beat, only faster: ingest usage, evaluate SLOs (the degradation engine runs after each cycle
    and publishes a level change), reconcile (the routing table's copy of the level), every `cycle_s`."""

    def __init__(self, deployment_pk: int, cycle_s: float):
        super().__init__(daemon=True, name="control-loop")
        self.deployment_pk, self.cycle_s = deployment_pk, cycle_s
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.cycle_seconds: list[float] = []
        self.cycles: list[dict] = []  # wall time, level, burn rates the degradation engine saw

    def run(self) -> None:
        from django.db import connection

        from degradation.models import DegradationState
        from deployments.replicas.reconcile import reconcile_deployment
        from slo.tasks import evaluation_cycle
        from tenants.ingest import ingest_usage

        try:
            while not self.halt.is_set():
                started = time.monotonic()
                ingest_usage(budget_s=self.cycle_s)
                evaluation_cycle()
                reconcile_deployment(self.deployment_pk)
                state = DegradationState.objects.filter(deployment_id=self.deployment_pk).first()
                if state is not None:
                    self.cycles.append({"at": time.time(), "level": state.level, "burn_rates": state.burn_rates})
                self.cycle_seconds.append(time.monotonic() - started)
                self.halt.wait(max(0.0, self.cycle_s - (time.monotonic() - started)))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            self.error = error
        finally:
            connection.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(60)
        if self.error is not None:
            raise RuntimeError("the control loop failed") from self.error


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user, nice, system, irq, softirq, steal
REPLICA_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total")


def process_ticks(pid: int) -> int | None:
    """CPU time (user + system, clock ticks) of one process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(kid) for kid in children.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


class Sampler(threading.Thread):
    """Every second: who used the two cores (the replica, the gateway, this benchmark with its load
    generator, everything else on the machine) and the replica's running / waiting requests and
    preemptions. A shared machine's neighbours show up as `others`."""

    def __init__(self, replica_pid: int, gateway_pid: int, replica_url: str, interval_s: float = 1.0):
        super().__init__(daemon=True, name="sampler")
        self.replica_pid, self.gateway_pid, self.replica_url = replica_pid, gateway_pid, replica_url
        self.interval_s = interval_s
        self.halt = threading.Event()
        self.samples: list[dict] = []

    def groups(self) -> dict[str, list[int]]:
        groups = {"replica": [self.replica_pid, *descendants(self.replica_pid)],
                  "gateway": [self.gateway_pid, *descendants(self.gateway_pid)]}
        mine = {os.getpid(), *descendants(os.getpid())}
        groups["bench"] = sorted(mine - set(groups["replica"]) - set(groups["gateway"]))
        return groups

    def run(self) -> None:
        last_ticks = {pid: process_ticks(pid) or 0 for pids in self.groups().values() for pid in pids}
        last_stat, last_at = self.machine(), time.time()
        while not self.halt.wait(self.interval_s):
            at, stat = time.time(), self.machine()
            seconds = at - last_at
            sample: dict = {"at": at}
            ticks_now: dict[int, int] = {}
            for group, pids in self.groups().items():
                used = 0
                for pid in pids:
                    ticks = process_ticks(pid)
                    if ticks is not None:  # a process new since the last sample (a load generator) counts whole
                        ticks_now[pid] = ticks
                        used += ticks - last_ticks.get(pid, 0)
                sample[f"{group}_cores"] = round(used / CLOCK_TICKS / seconds, 3)
            busy = sum(stat[i] - last_stat[i] for i in BUSY_FIELDS)
            total = sum(stat[:8]) - sum(last_stat[:8])
            sample["machine_busy_cores"] = round(busy / total * (os.cpu_count() or 1), 3) if total else None
            sample.update(self.replica_gauges())
            self.samples.append(sample)
            last_ticks, last_stat, last_at = ticks_now, stat, at

    @staticmethod
    def machine() -> list[int]:
        return [int(field) for field in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]

    def replica_gauges(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"{self.replica_url}/metrics", timeout=1).text
        except httpx.HTTPError:
            return {}
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in REPLICA_GAUGES:
                    key = sample.name.removeprefix("vllm:")
                    values[key] = values.get(key, 0) + sample.value
        return values

    def summary(self, start: float, end: float, bin_s: float = 10) -> dict:
        """Means over [start, end], and per `bin_s` seconds from start (time series for reading a run)."""
        keys = ("replica_cores", "gateway_cores", "bench_cores", "machine_busy_cores", "num_requests_running",
                "num_requests_waiting")

        def means(samples: list[dict]) -> dict:
            out = {}
            for key in keys:
                values = [s[key] for s in samples if s.get(key) is not None]
                out[key] = round(sum(values) / len(values), 2) if values else None
            if out["machine_busy_cores"] is not None:
                ours = sum(out[k] or 0 for k in ("replica_cores", "gateway_cores", "bench_cores"))
                out["others_cores"] = round(max(0.0, out["machine_busy_cores"] - ours), 2)
            preemptions = [s["num_preemptions_total"] for s in samples if "num_preemptions_total" in s]
            out["preemptions"] = int(preemptions[-1] - preemptions[0]) if len(preemptions) > 1 else 0
            return out

        inside = [s for s in self.samples if start <= s["at"] <= end]
        bins = {}
        for sample in inside:
            bins.setdefault(int((sample["at"] - start) // bin_s * bin_s), []).append(sample)
        return {"mean": means(inside), "per_10s": {str(at): means(group) for at, group in sorted(bins.items())}}


@dataclass
class Loops:
    control: ControlLoop
    watcher: LevelWatcher
    sampler: Sampler

    def start(self) -> None:
        for loop in (self.control, self.watcher, self.sampler):
            loop.start()

    def stop(self) -> None:
        self.watcher.halt.set()
        self.sampler.halt.set()
        self.control.stop()


class LevelWatcher(threading.Thread):
    """Reads the degradation level published for the gateways as they see it: the later of the
    routing table's entry and the degradation entry."""

    def __init__(self, redis_url: str, interval_s: float = 0.2):
        super().__init__(daemon=True, name="level-watcher")
        self.client = redis.Redis.from_url(redis_url)
        self.interval_s = interval_s
        self.halt = threading.Event()
        self.changes: list[tuple[float, int]] = []  # (wall time, level published)

    def level(self) -> int:
        from runtime.gateway.contract import DEGRADATION_KEY, ROUTING_KEY
        from runtime.gateway.state import DegradationEntry, Route, with_degradation

        with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(ROUTING_KEY, DEPLOYMENT)
            pipe.hget(DEGRADATION_KEY, DEPLOYMENT)
            route_raw, entry_raw = pipe.execute()
        if not route_raw:
            return 0
        routes = {DEPLOYMENT: Route.from_json(json.loads(route_raw))}
        entries = {DEPLOYMENT: DegradationEntry.from_json(json.loads(entry_raw))} if entry_raw else {}
        degradation = with_degradation(routes, entries)[DEPLOYMENT].degradation
        return degradation.level if degradation else 0

    def run(self) -> None:
        while not self.halt.is_set():
            level = self.level()
            if not self.changes or self.changes[-1][1] != level:
                self.changes.append((time.time(), level))
            self.halt.wait(self.interval_s)

    def level_at(self, at: float) -> int:
        level = 0
        for when, value in self.changes:
            if when > at:
                break
            level = value
        return level


# ------------------------------------------------------------------ load


def load(config: BenchConfig) -> dict:
    """run_benchmark in a process of its own: the control thread's Python never delays its clock."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_benchmark, config).result()


def base_config(platform_: Platform, args: argparse.Namespace, **fields) -> BenchConfig:
    settings = dict(base_url=platform_.base_url, model=DEPLOYMENT, api_key=platform_.keys["high"], endpoint="chat",
                    input_len=LengthRange(args.input_len, args.input_len),
                    output_len=LengthRange(args.output_len, args.output_len), seed=args.seed, show_progress=False,
                    timeout_s=120)
    settings.update(fields)
    return BenchConfig(**settings)


def percentiles_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"p50": None, "p95": None, "p99": None}
    values = np.asarray(values_s) * 1000
    return {f"p{p}": round(float(np.percentile(values, p)), 1) for p in (50, 95, 99)}


def class_figures(metrics: dict, name: str, threshold_ms: float, phases: list[str] | None) -> dict:
    rows = [i for i, c in enumerate(metrics["request_classes"]) if c == name]
    ok = [i for i in rows if not metrics["error_kinds"][i]]
    good = {i for i in ok if metrics["ttfts"][i] * 1000 <= threshold_ms}
    summary = metrics["classes"][name]
    figures = {
        "requests": len(rows),
        "completed": len(ok),
        "ttft_slo_attainment": round(len(good) / len(rows), 4) if rows else None,
        "goodput_rps": round(summary["request_goodput"], 3),
        "ttft_ms": percentiles_ms([metrics["ttfts"][i] for i in ok]),
        "e2el_ms": percentiles_ms([metrics["e2els"][i] for i in ok]),
        "shed_degraded_share": round(sum(metrics["error_codes"][i] == "degraded" for i in rows) / len(rows), 4)
        if rows else None,
        "errors": dict(Counter(f"{metrics['error_kinds'][i]} {metrics['error_codes'][i]}".strip()
                               for i in rows if metrics["error_kinds"][i])),
    }
    if phases is not None:  # where the misses were: by the policy's phase when each request was sent
        figures["by_phase"] = {
            phase: {"requests": len(sent), "met": sum(i in good for i in sent)}
            for phase in PHASES if (sent := [i for i in rows if phases[i] == phase])}
    return figures


PHASES = ("before level 1", "level 1, admitted low work draining", "level 1", "level 0 again")


def policy_phases(sent_at: list[float], level_at, first_up: float | None, drained: float | None) -> list[str]:
    """Each request's phase, from the level published when it was sent (times from the load start)."""
    phases = []
    for sent in sent_at:
        if level_at(sent) >= 1:
            phases.append(PHASES[1] if drained is not None and sent < drained else PHASES[2])
        else:
            phases.append(PHASES[0] if first_up is None or sent < first_up else PHASES[3])
    return phases


def drained_at(metrics: dict, since: float | None) -> float | None:
    """When the last low-priority request admitted before shedding began finished (from the load
    start): until then the replica still runs the work admitted before the policy acted."""
    if since is None:
        return None
    ends = [sent + e2el for sent, e2el, name, kind in zip(
        metrics["sent_at"], metrics["e2els"], metrics["request_classes"], metrics["error_kinds"], strict=True)
        if name == "low" and not kind and sent < since]
    return max(ends, default=since)


def wait_for_next_minute(min_wait_s: float = 1.0) -> None:
    """Sleep to 1 s past the next minute: the policy's window starts empty (a 1-minute window is
    the current clock minute's SLI rows)."""
    now = time.time()
    target = (math.floor((now + min_wait_s) / 60) + 1) * 60 + 1
    print(f"waiting {target - now:.0f} s for the top of the minute ...", flush=True)
    time.sleep(target - now)


def overload_run(label: str, platform_: Platform, args: argparse.Namespace, rate: float, threshold_ms: float,
                 loops: Loops, policy: bool) -> dict:
    from degradation.models import LevelChange

    watcher = loops.watcher
    classes = [RequestClass("high", platform_.keys["high"], args.high_share),
               RequestClass("low", platform_.keys["low"], 1 - args.high_share)]
    config = base_config(platform_, args, num_prompts=max(10, round(rate * args.duration)), request_rate=rate,
                         request_classes=classes, goodput_slos_ms={"ttft": threshold_ms})
    print(f"run {label}: {config.num_prompts} requests at {rate:.2f} req/s "
          f"({'with' if policy else 'no'} degradation policy) ...", flush=True)
    with machine_load() as machine:
        metrics = load(config)
    start = metrics["started_at"]
    load_end = start + max(metrics["sent_at"])  # the last arrival: the offered load ends here
    result: dict = {"policy": policy, "offered_rps": round(rate, 3), "requests": config.num_prompts,
                    "duration_s": round(metrics["duration"], 1), "offered_load_s": round(load_end - start, 1),
                    "started_at": datetime.fromtimestamp(start, UTC).isoformat(), **machine.fields()}
    if policy:
        # Recovery: the last events ingested and evaluated (two cycles), then the level back at 0.
        time.sleep(2 * args.cycle_s)
        wait_for(lambda: watcher.level() == 0, args.hold_s + 240, "the level to return to 0")
    phases = None
    if policy:
        changes = list(LevelChange.objects.filter(deployment__name=DEPLOYMENT, at__gte=datetime.fromtimestamp(
            start - 5, UTC)).order_by("at", "id"))
        published = [(when - start, level) for when, level in watcher.changes if when >= start - 5]
        degraded = [sent for sent, code in zip(metrics["sent_at"], metrics["error_codes"], strict=True)
                    if code == "degraded"]
        ups = [c for c in changes if c.to_level > c.from_level]
        first_up = next((t for t, level in published if level >= 1 and t >= 0), None)
        last_to_zero = next((t for t, level in reversed(published) if level == 0), None)
        offered_s = load_end - start
        drained = drained_at(metrics, min(degraded) if degraded else None)
        phases = policy_phases(metrics["sent_at"], lambda sent: watcher.level_at(start + sent), first_up, drained)
        result["policy_timing_s"] = {
            "level_1_decided": round(ups[0].at.timestamp() - start, 1) if ups else None,
            "level_1_published": round(first_up, 1) if first_up is not None else None,
            "first_degraded_503": round(min(degraded), 1) if degraded else None,
            "admitted_low_work_drained": round(drained, 1) if drained is not None else None,
            "level_at_load_end": watcher.level_at(load_end),
            # Past the end of the offered load; negative: it was back at 0 that long before the end.
            "back_to_level_0_after_load_end": round(last_to_zero - offered_s, 1) if last_to_zero is not None else None,
        }
        result["level_changes"] = [
            {"at_s": round(c.at.timestamp() - start, 1), "from": c.from_level, "to": c.to_level, "reason": c.reason,
             "burn_rates": c.burn_rates} for c in changes]
        result["published_levels"] = [{"at_s": round(t, 1), "level": level} for t, level in published]
        result["share_of_requests_sent_at_level_1"] = round(
            sum(watcher.level_at(start + sent) >= 1 for sent in metrics["sent_at"]) / len(metrics["sent_at"]), 3)
        result["cycles"] = [{"at_s": round(c["at"] - start, 1), "level": c["level"], "burn_rates": c["burn_rates"]}
                            for c in loops.control.cycles if start - 5 <= c["at"] <= load_end + args.hold_s + 240]
    result["cpu_and_replica"] = loops.sampler.summary(start, start + metrics["duration"])
    result["high"] = class_figures(metrics, "high", threshold_ms, phases)
    result["low"] = class_figures(metrics, "low", threshold_ms, phases)
    result["goodput_rps"] = round(metrics["request_goodput"], 3)
    result["throughput_rps"] = round(metrics["request_throughput"], 3)
    result["per_request"] = [
        [c, round(sent, 3), round(ttft * 1000, 1), round(e2el * 1000, 1), f"{kind} {code}".strip()]
        for c, sent, ttft, e2el, kind, code in zip(
            metrics["request_classes"], metrics["sent_at"], metrics["ttfts"], metrics["e2els"],
            metrics["error_kinds"], metrics["error_codes"], strict=True)]
    return result


# ------------------------------------------------------------------ the run


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    model_dir = args.model_dir or HERE / "work" / args.preset
    if not (model_dir / "config.json").is_file():
        from runtime.engine.demo_model import write_demo_model

        print(f"writing the {args.preset} demo checkpoint to {model_dir} ...", flush=True)
        write_demo_model(model_dir, preset=args.preset, seed=0)
    return model_dir


def run(args: argparse.Namespace, platform_: Platform, redis_url: str) -> dict:
    from degradation.services import policy_save
    from slo.services import slo_create

    results: dict = {}
    closed_loop = dict(num_prompts=args.saturation_requests, max_concurrency=args.saturation_concurrency)
    print(f"warm-up: {args.warmup_requests} requests, {args.saturation_concurrency} at a time ...", flush=True)
    load(base_config(platform_, args, **{**closed_loop, "num_prompts": args.warmup_requests, "seed": args.seed + 7}))
    print(f"saturation: closed loop of {args.saturation_concurrency} clients ...", flush=True)
    with machine_load() as machine:
        saturation = load(base_config(platform_, args, **closed_loop, seed=args.seed + 8))
    sat_rps = saturation["request_throughput"]
    results["saturation"] = {**closed_loop, "completed": saturation["completed"], "errors": saturation["errors"],
                             "rps": round(sat_rps, 3), "ttft_ms_p50": round(saturation["median_ttft_ms"], 1),
                             "tpot_ms_p50": round(saturation["median_tpot_ms"], 1), **machine.fields()}
    print(f"saturation {sat_rps:.2f} req/s (p50 TTFT {saturation['median_ttft_ms']:.0f} ms, "
          f"TPOT {saturation['median_tpot_ms']:.0f} ms)", flush=True)
    unloaded = load(base_config(platform_, args, num_prompts=20, max_concurrency=1, seed=args.seed + 9))
    unloaded_ms = unloaded["median_ttft_ms"]
    threshold_ms = math.ceil(args.ttft_multiple * unloaded_ms / 10) * 10
    results["unloaded"] = {"requests": 20, "ttft_ms_p50": round(unloaded_ms, 1),
                           "ttft_ms_p90": round(unloaded["p90_ttft_ms"], 1), "failed": unloaded["failed"]}
    print(f"unloaded TTFT p50 {unloaded_ms:.0f} ms -> SLO threshold {threshold_ms} ms", flush=True)
    slo = slo_create(actor=None, name=f"{DEPLOYMENT}-ttft", scope="deployment", deployment=platform_.deployment,
                     sli_kind="latency", ttft_ms=threshold_ms, objective=args.objective, window="1d",
                     budgeting="occurrences", min_requests=args.min_requests)
    results["slo"] = {"name": slo.name, "sli": "latency", "ttft_ms": threshold_ms, "objective": args.objective,
                      "window": "1d", "min_requests": args.min_requests}
    rate = args.overload * sat_rps

    loops = Loops(ControlLoop(platform_.deployment.pk, args.cycle_s), LevelWatcher(redis_url),
                  Sampler(platform_.replica_pid, platform_.gateway.pid, platform_.replica_url))
    loops.start()
    try:
        results["a_no_policy"] = overload_run("a", platform_, args, rate, threshold_ms, loops, policy=False)
        levels = [{"name": "shed-low", "enter_burn_rate": args.enter_burn_rate,
                   "exit_burn_rate": args.exit_burn_rate, "actions": {"shed_below_priority": SHED_BELOW}}]
        # Saved once run (a) has left the window: the policy must not act on (a)'s burn.
        wait_for_next_minute()
        policy_save(deployment=platform_.deployment, actor=None, enabled=True, window_minutes=args.window_minutes,
                    hold_s=args.hold_s, slos=[slo], levels=levels)
        results["policy"] = {"window": f"{args.window_minutes}m", "hold_s": args.hold_s, "slos": [slo.name],
                             "levels": levels}
        results["b_policy"] = overload_run("b", platform_, args, rate, threshold_ms, loops, policy=True)
    finally:
        loops.stop()
    cycle_seconds = loops.control.cycle_seconds
    results["control_cycle_s"] = {"interval": args.cycle_s, "p50": round(float(np.median(cycle_seconds)), 3),
                                  "max": round(max(cycle_seconds), 3)}
    results["replica_restarts"] = platform_.replica_restarts()
    return results


def table(results: dict) -> str:
    a, b = results["a_no_policy"], results["b_policy"]

    def pct(value):
        return "-" if value is None else f"{100 * value:.1f} %"

    def ms(figures):
        t = figures["ttft_ms"]
        return "-" if t["p50"] is None else f"{t['p50']:.0f} / {t['p95']:.0f} / {t['p99']:.0f}"

    def cores(run):
        m = run["cpu_and_replica"]["mean"]
        return " / ".join("-" if m.get(k) is None else f"{m[k]:.2f}"
                          for k in ("replica_cores", "gateway_cores", "bench_cores", "others_cores"))

    def errors(figures):
        return ", ".join(f"{count} {kind}" for kind, count in sorted(figures["errors"].items())) or "-"

    rows = [
        ("offered load (req/s), requests", f"{a['offered_rps']:.2f}, {a['requests']}",
         f"{b['offered_rps']:.2f}, {b['requests']}"),
        (f"high: TTFT <= {results['slo']['ttft_ms']} ms (attainment)", pct(a["high"]["ttft_slo_attainment"]),
         pct(b["high"]["ttft_slo_attainment"])),
        ("high: TTFT p50 / p95 / p99 (ms)", ms(a["high"]), ms(b["high"])),
        ("high: errors", errors(a["high"]), errors(b["high"])),
        ("goodput all (req/s)", f"{a['goodput_rps']:.2f}", f"{b['goodput_rps']:.2f}"),
        ("goodput high / low (req/s)", f"{a['high']['goodput_rps']:.2f} / {a['low']['goodput_rps']:.2f}",
         f"{b['high']['goodput_rps']:.2f} / {b['low']['goodput_rps']:.2f}"),
        ("low: shed with 503 degraded", pct(a["low"]["shed_degraded_share"]), pct(b["low"]["shed_degraded_share"])),
        ("low: errors", errors(a["low"]), errors(b["low"])),
        ("load average before / after", f"{a['load_average_before'][0]} / {a['load_average_after'][0]}",
         f"{b['load_average_before'][0]} / {b['load_average_after'][0]}"),
        ("cores used: replica / gateway / bench / others", cores(a), cores(b)),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'(a) no policy':>28}  {'(b) policy':>28}"]
    lines += [f"{label:<{width}}  {left:>28}  {right:>28}" for label, left, right in rows]
    timing = b["policy_timing_s"]
    lines += [
        "policy run (b), seconds from the load start:",
        f"  level 1 decided {timing['level_1_decided']}, published {timing['level_1_published']}, first 503 "
        f"degraded {timing['first_degraded_503']}; low work admitted before shedding drained by "
        f"{timing['admitted_low_work_drained']}",
        "  level changes: " + (", ".join(f"{c['from']}->{c['to']} at {c['at_s']:.0f} ({c['reason']})"
                                          for c in b["level_changes"]) or "none"),
        f"  level at load end {timing['level_at_load_end']}; level 0 for good "
        f"{timing['back_to_level_0_after_load_end']} s after the load end",
        "  high class, met / sent by phase: " + "; ".join(f"{phase} {v['met']}/{v['requests']}"
                                                         for phase, v in b["high"]["by_phase"].items()),
    ]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url or not os.environ.get("DATABASE_URL"):
        sys.exit("set DATABASE_URL and REDIS_URL (see the module docstring)")
    if redis.Redis.from_url(redis_url).dbsize():
        sys.exit(f"{redis_url} is not empty: give REDIS_URL a Redis database of its own (it is emptied after)")
    os.environ.setdefault("INFEROPS_DATA_DIR", str(HERE / "work" / "data"))
    os.environ.setdefault("INFEROPS_LOG_LEVEL", "WARNING")  # the level moves still show
    model_dir = ensure_checkpoint(args)
    admin_url = django_on_scratch_database(args.database)
    started = time.time()
    platform_ = Platform(args, model_dir, redis_url)
    try:
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        platform_.start()
        results = run(args, platform_, redis_url)
    finally:
        from django.db import connections

        try:
            platform_.stop()
        finally:
            connections.close_all()
            recreate_scratch_database(admin_url, args.database, drop_only=True)
            redis.Redis.from_url(redis_url).flushdb()
    head = {"date": datetime.now(UTC).date().isoformat(), "git": git_revision(),
            "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version()},
            "checkpoint": f"demo {args.preset} (seed 0)", "workload": {
                "endpoint": "chat (streaming)", "input_words": args.input_len, "output_tokens": args.output_len,
                "high_share": args.high_share, "overload": args.overload, "duration_s": args.duration,
                "seed": args.seed, "priorities": PRIORITIES, "shed_below_priority": SHED_BELOW},
            "wall_s": round(time.time() - started)}
    results = {**head, **results}
    path = args.result_json or HERE / f"results-{head['date']}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"results written to {path}")
    return 0


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
