"""Gateway overhead: direct to the upstream vs through `inferops gateway` vs through LiteLLM's proxy.

Same workload, same run: a closed loop of `--concurrency` (64) clients, each sending streamed
chat completions one after the other to one target, for a warm-up and then a measured window;
targets take turns, `--rounds` times, so drift on the machine hits all of them alike. Two phases:
- paced: the upstream streams its tokens `--paced-token-delay-ms` apart (a replica's pace), so
  the offered load stays moderate and TTFT shows the latency a proxy adds;
- unpaced: the upstream answers at once, so the closed loop runs each proxy flat out and
  requests/s shows what one proxy process sustains.

- upstream: bench/gateway/fast_upstream.py, a canned OpenAI-compatible responder (no model):
  what is measured is the proxy alone.
- inferops: `inferops gateway` with keys and rate limits on: a key with generous rpm/tpm and
  max_concurrent limits (and tenant rpm/tpm limits), published to a Redis of this run, and a
  routing entry pointing at the upstream. Every request runs the admission and release Lua
  scripts and writes a usage event.
- litellm: LiteLLM's proxy (its own venv, bench/gateway/litellm_setup.sh), one worker, with a
  virtual key with the same rpm/tpm limits through custom auth (bench/gateway/litellm_auth.py
  says why not its Postgres-backed keys).

TTFT is "request written → first chunk with content" read by this client (a lean HTTP/1.1
client on httptools, so the client's own cost is small). Requests/s is what the target
completed in the measured window, its one process pinned to a core.

Two cores only, so processes are pinned (taskset / sched_setaffinity): the proxy under test
on `--proxy-cpu` with the run's Redis (the gateway's dependency); the load generator and the
upstreams on `--client-cpu`. Pinning cannot keep other people's work off those cores, so the
CPU seconds and run-queue wait of each proxy process are read from /proc: requests per proxy
CPU-second is the figure that holds when a shared machine, not the proxy, limits requests/s.

    .venv/bin/python bench/gateway/overhead_bench.py            # writes bench/gateway/results.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from runtime.gateway.http1 import Http1Pool  # noqa: E402  (the repo root must be on the path first)

PHASES = {"paced": "bench-paced", "unpaced": "bench-unpaced"}  # phase -> deployment (model) name
GENEROUS_RPM = 10_000_000
GENEROUS_TPM = 10_000_000_000
GENEROUS_CONCURRENCY = 10_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- load generation -----------------------------------------------------------------------------


@dataclass
class Sample:
    started: float
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


def _first_content_in(events: list[bytes]) -> bool:
    """True when one of these whole SSE events carries non-empty generated text."""
    for event in events:
        if not event.startswith(b"data: {"):
            continue
        try:
            parsed = json.loads(event[6:])
        except ValueError:
            continue
        for choice in parsed.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                return True
    return False


class StreamingClient:
    """Sends one streamed chat completion and times it; never raises."""

    def __init__(self, pool: Http1Pool, url: str, api_key: str, model: str, max_tokens: int) -> None:
        self.pool = pool
        self.url = url
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
        self.body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": "Say something short about gateways and their overhead, please."}]}).encode()

    async def send(self) -> Sample:
        started = time.perf_counter()
        sample = Sample(started, ok=False)
        try:
            response = await self.pool.post(self.url, self.body, self.headers, head_timeout_s=60, read_timeout_s=60)
        except Exception as exc:  # connect, timeout, broken: all are the target's errors here
            sample.error = f"request: {type(exc).__name__}"
            return sample
        try:
            if response.status != 200:
                await response.read()
                sample.error = f"status {response.status}"
                return sample
            pending, tail = b"", b""
            while (chunk := await response.next_chunk()) is not None:
                if sample.ttft_s is None:
                    pending += chunk
                    cut = pending.rfind(b"\n\n")
                    if cut >= 0:
                        if _first_content_in(pending[:cut].split(b"\n\n")):
                            sample.ttft_s = time.perf_counter() - started
                        pending = pending[cut + 2:]
                tail = (tail + chunk)[-64:]
            sample.e2e_s = time.perf_counter() - started
            if b"data: [DONE]" not in tail:
                sample.error = "stream ended without [DONE]"
            elif sample.ttft_s is None:
                sample.error = "no content chunk"
            else:
                sample.ok = True
        except Exception as exc:
            sample.error = f"stream: {type(exc).__name__}"
        finally:
            response.close()
        return sample


async def drive(client: StreamingClient, concurrency: int, warmup_s: float, duration_s: float) -> list[Sample]:
    """Closed loop: `concurrency` workers, each sending its next request when the last one ended.

    A request counts when it ends inside the measured window, whenever it started: a slow proxy's
    requests can take longer than the window, and counting only those started inside it would
    report a throughput of zero. Requests still open when the window closes are cancelled.
    """
    loop = asyncio.get_running_loop()
    measure_from = loop.time() + warmup_s
    stop_at = measure_from + duration_s
    samples: list[Sample] = []

    async def worker() -> None:
        while True:
            sample = await client.send()
            finished = loop.time()
            if finished > stop_at:
                return
            if finished >= measure_from:
                samples.append(sample)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.wait(workers, timeout=stop_at - loop.time())
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return samples


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_tree_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    total, frontier = 0.0, [root_pid]
    while frontier:
        pid = frontier.pop()
        total += times.get(pid, 0.0)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return total


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's threads spent runnable but waiting for a CPU (/proc schedstat):
    on a shared machine, how much other work kept the process off its core."""
    total = 0.0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(schedstat.read_text().split()[1]) / 1e9
    return total


class Processes:
    """Starts pinned child processes in their own sessions and ends exactly those."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cpu: int, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(["taskset", "-c", str(cpu), *argv], stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
        self.started[name] = process
        return process

    def stop_all(self) -> None:
        for process in self.started.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.started.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def wait_for_http(url: str, timeout_s: float, process: subprocess.Popen, name: str) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status < 500:
                    return
        except urllib.error.HTTPError as error:
            if error.code < 500:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{name} did not answer {url} within {timeout_s:g} s")


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s:g} s")


# -- keys for both proxies ------------------------------------------------------------------------


def new_inferops_key() -> tuple[str, str]:
    prefix = secrets.token_hex(4)
    return prefix, f"iop_{prefix}_{secrets.token_urlsafe(30)[:40]}"


def publish_inferops_state(client: redis.Redis, upstream_urls: dict[str, str], keys: dict[str, dict]) -> None:
    """What the control plane would publish (contract: inferops:routing and inferops:keys)."""
    for replica_id, (deployment, upstream_url) in enumerate(upstream_urls.items(), start=1):
        route = {"deployment": deployment, "model": "fast-upstream", "task": "generate", "backend": "bench",
                 "versions": [{"version": 1, "weight": 100, "replicas": [{"id": replica_id, "url": upstream_url}]}],
                 "published_at": time.time()}
        client.hset("inferops:routing", deployment, json.dumps(route))
    client.incr("inferops:routing:generation")
    for secret, limits in keys.items():
        prefix = secret.split("_")[1]
        entry = {"prefix": prefix, "name": f"bench-{prefix}", "tenant": f"bench-tenant-{prefix}",
                 "deployments": list(upstream_urls), "priority": 0, "expires_at": None, "limits": limits}
        client.hset("inferops:keys", hashlib.sha256(secret.encode()).hexdigest(), json.dumps(entry))
    client.incr("inferops:keys:generation")


def write_litellm_files(work: Path, upstream_urls: dict[str, str], keys: dict[str, dict], master_key: str) -> Path:
    """The LiteLLM config (models + custom auth) and its key file; returns the config path."""
    shutil.copy(HERE / "litellm_auth.py", work / "litellm_auth.py")
    hashed = {hashlib.sha256(secret.encode()).hexdigest(): {**limits, "models": list(upstream_urls)}
              for secret, limits in keys.items()}
    (work / "litellm_keys.json").write_text(json.dumps(hashed))
    config = work / "litellm_config.yaml"
    models = "".join(
        f"  - model_name: {deployment}\n"
        "    litellm_params:\n"
        "      model: openai/fast-upstream\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: unused-by-the-fast-upstream\n"
        # A self-hosted model has no price in LiteLLM's cost map; declaring it free is what an
        # operator would do, and spares LiteLLM a zero-cost diagnostic on every request.
        "      input_cost_per_token: 0\n"
        "      output_cost_per_token: 0\n" for deployment, upstream_url in upstream_urls.items())
    config.write_text(
        "model_list:\n" + models +
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
        "  drop_params: true\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
        "  custom_auth: litellm_auth.user_api_key_auth\n")
    return config


# -- summary -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@dataclass
class TargetRun:
    """What one target did in one phase: samples and seconds measured, CPU its process spent."""

    name: str
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    proxy_cpu_s: float | None = None
    redis_cpu_s: float = 0.0
    proxy_wait_s: float | None = None

    def add(self, other: TargetRun) -> None:
        self.samples += other.samples
        self.seconds += other.seconds
        self.redis_cpu_s += other.redis_cpu_s
        if other.proxy_cpu_s is not None:
            self.proxy_cpu_s = (self.proxy_cpu_s or 0.0) + other.proxy_cpu_s
        if other.proxy_wait_s is not None:
            self.proxy_wait_s = (self.proxy_wait_s or 0.0) + other.proxy_wait_s

    def summary(self) -> dict:
        ok = [s for s in self.samples if s.ok]
        ttfts = [s.ttft_s * 1000 for s in ok]
        e2es = [s.e2e_s * 1000 for s in ok]
        errors: dict[str, int] = {}
        for sample in self.samples:
            if not sample.ok:
                errors[sample.error] = errors.get(sample.error, 0) + 1
        result = {"requests": len(self.samples), "ok": len(ok), "errors": sum(errors.values()),
                  "error_kinds": errors, "seconds": round(self.seconds, 2),
                  "requests_per_s": round(len(ok) / self.seconds, 1) if self.seconds else None,
                  "ttft_ms": {"p50": _round(percentile(ttfts, 50)), "p99": _round(percentile(ttfts, 99))},
                  "e2e_ms": {"p50": _round(percentile(e2es, 50)), "p99": _round(percentile(e2es, 99))}}
        if self.proxy_cpu_s is not None:
            result["proxy_cpu_s"] = round(self.proxy_cpu_s, 2)
            result["proxy_cpu_utilisation"] = round(self.proxy_cpu_s / self.seconds, 2)
            if self.proxy_wait_s is not None:
                result["proxy_runqueue_wait_s"] = round(self.proxy_wait_s, 2)
            result["requests_per_proxy_cpu_s"] = round(len(ok) / self.proxy_cpu_s, 1) if self.proxy_cpu_s else None
            with_redis = self.proxy_cpu_s + self.redis_cpu_s
            result["redis_cpu_s"] = round(self.redis_cpu_s, 2)
            result["requests_per_proxy_and_redis_cpu_s"] = round(len(ok) / with_redis, 1) if with_redis else None
        return result


def added_ttft(target: dict, direct: dict) -> dict:
    if target["ttft_ms"]["p50"] is None or direct["ttft_ms"]["p50"] is None:
        return {"p50": None, "p99": None}
    return {q: _round(target["ttft_ms"][q] - direct["ttft_ms"][q]) for q in ("p50", "p99")}


def compare(phases: dict[str, dict[str, dict]]) -> dict:
    """Added TTFT per phase and proxy; the targets: added p99 TTFT (paced) ≤ 0.5× LiteLLM's,
    requests/s (unpaced) ≥ 2× LiteLLM's."""
    verdict: dict = {}
    for phase, targets in phases.items():
        for proxy in ("inferops", "litellm"):
            if proxy in targets:
                verdict[f"{phase}_{proxy}_added_ttft_ms"] = added_ttft(targets[proxy], targets["direct"])
    paced, unpaced = phases.get("paced", {}), phases.get("unpaced", {})
    if "litellm" in paced and paced["litellm"]["ok"] and paced["inferops"]["ok"]:
        ours, peer = verdict["paced_inferops_added_ttft_ms"]["p99"], verdict["paced_litellm_added_ttft_ms"]["p99"]
        ratio = ours / peer if peer and peer > 0 else None
        verdict["added_p99_ttft_ratio"] = _round(ratio)
        verdict["added_p99_ttft_target_met"] = ratio is not None and ratio <= 0.5
    if "litellm" in unpaced and unpaced["litellm"]["ok"]:
        ours, peer = unpaced["inferops"], unpaced["litellm"]
        verdict["requests_per_s_ratio"] = _round(ours["requests_per_s"] / peer["requests_per_s"])
        verdict["requests_per_s_target_met"] = verdict["requests_per_s_ratio"] >= 2
        if ours.get("requests_per_proxy_and_redis_cpu_s") and peer.get("requests_per_proxy_cpu_s"):
            # Ours pays for its Redis too; LiteLLM keeps its counters in its own process.
            verdict["requests_per_cpu_s_ratio"] = _round(ours["requests_per_proxy_and_redis_cpu_s"]
                                                         / peer["requests_per_proxy_cpu_s"])
    return verdict


# -- the run -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir).resolve()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.processes = Processes(self.work)
        self.pids: dict[str, int] = {}
        self.base_urls: dict[str, str] = {}  # target -> URL of its chat completions endpoint
        self.keys: dict[str, str] = {"direct": "unused"}
        self.redis_url = ""
        self.redis_pid = 0

    def start(self) -> None:
        args = self.args
        redis_port = free_port()
        # Redis sits with the proxy: it is part of what the gateway costs (its admission and usage
        # writes wait on it), and a client core that the closed loop keeps busy would delay it.
        self.redis_pid = self.processes.start("redis", args.proxy_cpu, [
            "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.work)]).pid
        upstream_urls = {}
        for phase, delay_ms in (("paced", args.paced_token_delay_ms), ("unpaced", 0.0)):
            port = free_port()
            self.processes.start(f"upstream-{phase}", args.client_cpu, [
                sys.executable, str(HERE / "fast_upstream.py"), "--port", str(port), "--tokens", str(args.tokens),
                "--token-delay-ms", str(delay_ms)])
            wait_for_port(port, 20)
            upstream_urls[PHASES[phase]] = f"http://127.0.0.1:{port}"
        wait_for_port(redis_port, 10)
        self.upstream_urls = upstream_urls
        self.base_urls["direct"] = "{upstream}/v1/chat/completions"

        _, secret = new_inferops_key()
        _, tight_secret = new_inferops_key()
        generous = {"rpm": GENEROUS_RPM, "tpm": GENEROUS_TPM, "max_concurrent": GENEROUS_CONCURRENCY}
        tight = {"rpm": 2, "tpm": GENEROUS_TPM, "max_concurrent": GENEROUS_CONCURRENCY}
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        publish_inferops_state(redis.Redis.from_url(self.redis_url), upstream_urls, {
            secret: {"key": generous, "tenant": {"rpm": GENEROUS_RPM, "tpm": GENEROUS_TPM, "max_concurrent": None}},
            tight_secret: {"key": tight, "tenant": {"rpm": None, "tpm": None, "max_concurrent": None}}})
        port = free_port()
        gateway = self.processes.start("inferops", args.proxy_cpu, [
            str(REPO / ".venv/bin/python"), "-m", "project.cli", "gateway", "--port", str(port),
            "--redis-url", self.redis_url, "--instance", "overhead-bench", "--spool-dir", str(self.work / "spool"),
            "--max-outstanding-per-replica", str(4 * args.concurrency), "--log-level", "warning"], cwd=REPO)
        self.base_urls["inferops"] = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.keys["inferops"], self.keys["inferops-tight"] = secret, tight_secret
        self.pids["inferops"] = gateway.pid
        wait_for_http(f"http://127.0.0.1:{port}/health", 60, gateway, "inferops gateway")
        if args.litellm_python:
            self._start_litellm(generous, tight)

    def _start_litellm(self, generous: dict, tight: dict) -> None:
        args = self.args
        secret, tight_secret = f"sk-bench-{secrets.token_hex(16)}", f"sk-tight-{secrets.token_hex(16)}"
        as_litellm = {secret: {"rpm": generous["rpm"], "tpm": generous["tpm"],
                               "max_parallel_requests": generous["max_concurrent"]},
                      tight_secret: {"rpm": tight["rpm"], "tpm": tight["tpm"],
                                     "max_parallel_requests": tight["max_concurrent"]}}
        config = write_litellm_files(self.work, self.upstream_urls, as_litellm, f"sk-master-{secrets.token_hex(8)}")
        port = free_port()
        litellm_bin = str(Path(args.litellm_python).parent / "litellm")
        process = self.processes.start("litellm", args.proxy_cpu, [
            litellm_bin, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
            env={"LITELLM_BENCH_KEYS": str(self.work / "litellm_keys.json"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                 "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR",
                 "LITELLM_MODE": "PRODUCTION", "PYTHONPATH": str(self.work)},
            cwd=self.work)
        self.base_urls["litellm"] = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.keys["litellm"], self.keys["litellm-tight"] = secret, tight_secret
        self.pids["litellm"] = process.pid
        wait_for_http(f"http://127.0.0.1:{port}/health/liveliness", 240, process, "litellm")

    def url(self, target: str, deployment: str) -> str:
        return self.base_urls[target].format(upstream=self.upstream_urls[deployment])

    def client(self, pool: Http1Pool, target: str, deployment: str, key: str | None = None) -> StreamingClient:
        return StreamingClient(pool, self.url(target, deployment), key or self.keys[target], deployment,
                               self.args.tokens)

    async def check_limits(self, pool: Http1Pool) -> dict:
        """Both proxies must refuse a bad key (401) and a key's third request in a minute over its 2 rpm (429)."""
        checks = {}
        deployment = PHASES["unpaced"]
        for name in [n for n in ("inferops", "litellm") if n in self.base_urls]:
            bad = await self.client(pool, name, deployment, "iop_00000000_not-a-key").send()
            tight = self.client(pool, name, deployment, self.keys[f"{name}-tight"])
            outcomes = [(await tight.send()).error for _ in range(3)]
            checks[name] = {"bad_key": bad.error, "tight_key_3_requests": outcomes,
                            "refused_as_expected": bad.error == "status 401" and outcomes == [None, None, "status 429"]}
        return checks

    async def measure_once(self, pool: Http1Pool, target: str, phase: str) -> TargetRun:
        args = self.args
        pid = self.pids.get(target)
        cpu_before = process_tree_cpu_s(pid) if pid else 0.0
        wait_before = runqueue_wait_s(pid) if pid else 0.0
        redis_before = process_tree_cpu_s(self.redis_pid)
        began = time.perf_counter()
        samples = await drive(self.client(pool, target, PHASES[phase]), args.concurrency, args.warmup_s,
                              args.duration_s)
        # CPU is read over warm-up + window and scaled to the window: the load is the same throughout.
        window_share = args.duration_s / (time.perf_counter() - began)
        run = TargetRun(target, samples, args.duration_s)
        run.redis_cpu_s = (process_tree_cpu_s(self.redis_pid) - redis_before) * window_share
        if pid:
            run.proxy_cpu_s = (process_tree_cpu_s(pid) - cpu_before) * window_share
            run.proxy_wait_s = (runqueue_wait_s(pid) - wait_before) * window_share
        return run

    async def measure(self) -> dict:
        args = self.args
        pool = Http1Pool(connect_timeout_s=10)
        checks = await self.check_limits(pool)
        targets = [name for name in ("direct", "inferops", "litellm") if name in self.base_urls]
        totals = {phase: {name: TargetRun(name) for name in targets} for phase in args.phases}
        rounds = []
        redis_cpu_start = process_tree_cpu_s(self.redis_pid)
        for round_index in range(args.rounds):
            for phase in args.phases:
                for name in targets:
                    run = await self.measure_once(pool, name, phase)
                    totals[phase][name].add(run)
                    summary = run.summary()
                    rounds.append({"round": round_index + 1, "phase": phase, "target": name, **summary})
                    print(f"round {round_index + 1} {phase:8s} {name:9s} {json.dumps(summary)}", flush=True)
                    await asyncio.sleep(1)  # let the last streams and usage writes settle
        pool.close()
        phases = {phase: {name: run.summary() for name, run in runs.items()} for phase, runs in totals.items()}
        usage_events = redis.Redis.from_url(self.redis_url).xlen("inferops:usage")
        return {"limit_checks": checks, "phases": phases, "comparison": compare(phases), "rounds": rounds,
                "redis_cpu_s_total": round(process_tree_cpu_s(self.redis_pid) - redis_cpu_start, 2),
                "inferops_usage_events_in_stream": usage_events}


def describe_setup(args: argparse.Namespace) -> dict:
    litellm_version = None
    if args.litellm_python:
        litellm_version = subprocess.run(
            [args.litellm_python, "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True, check=False).stdout.strip() or None
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "workload": {"concurrency": args.concurrency, "stream": True, "endpoint": "/v1/chat/completions",
                     "completion_tokens": args.tokens, "paced_token_delay_ms": args.paced_token_delay_ms,
                     "warmup_s": args.warmup_s, "measured_s_per_round": args.duration_s, "rounds": args.rounds,
                     "phases": args.phases},
        "upstream": "bench/gateway/fast_upstream.py: canned OpenAI-compatible stream, no model (proxy alone)",
        "keys_and_limits": "inferops: key rpm/tpm/max_concurrent + tenant rpm/tpm in Redis (Lua per request); "
                           "litellm: custom-auth key with rpm_limit/tpm_limit/max_parallel_requests (in memory)",
        "pinning": {"proxy_cpu": args.proxy_cpu, "client_cpu": args.client_cpu,
                    "on_proxy_cpu": "the proxy under test (inferops gateway or LiteLLM, one process each) and "
                                    "the run's redis-server (the gateway's limits and usage stream)",
                    "on_client_cpu": "load generator and both fast upstreams"},
        "litellm_version": litellm_version,
        "ttft": "request written by the client -> first SSE event with non-empty content read by the client",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default_litellm = HERE / ".venv-litellm/bin/python"
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per streamed answer")
    parser.add_argument("--paced-token-delay-ms", type=float, default=20.0,
                        help="upstream pause between tokens in the paced phase")
    parser.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured seconds per target, phase, round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--proxy-cpu", type=int, default=1)
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--litellm-python", default=str(default_litellm) if default_litellm.exists() else "",
                        help="python of LiteLLM's venv ('' skips LiteLLM)")
    parser.add_argument("--work-dir", default=str(HERE / "work/overhead"), help="logs, configs, Redis dir")
    parser.add_argument("--output", default=str(HERE / "results.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.sched_setaffinity(0, {args.client_cpu})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    setup = describe_setup(args)
    bench = Bench(args)
    try:
        bench.start()
        results = asyncio.run(bench.measure())
    finally:
        bench.processes.stop_all()
    Path(args.output).write_text(json.dumps({"setup": setup, **results}, indent=2) + "\n")
    print(json.dumps({"limit_checks": results["limit_checks"], "comparison": results["comparison"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
