"""Scrape cycle benchmark: 200 replica stubs, scraped and stored into Postgres.

Each stub serves the recorded vLLM 0.32 /metrics page (vllm-0.32-cpu-metrics.txt, 53 KB) on its
own loopback port, with counters, histograms and gauges that move on every request. The
scraper under test is `deployments.replicas.scraping.scrape_cycle` (bounded concurrent httpx fetches, one
batched store), the same code the Celery task runs. The peer, in the same run, is the naive
loop: `requests.get` one replica after the other, each stored on its own as it arrives.

Two more scenarios: busy replicas (every stub answers after 50 ms, as a loaded server may), and
3 dead replicas (nothing listening) plus 2 hanging ones (connect, never answer) to show that
they cost their timeout once, not once each.

Run from the repository root against a Postgres server where it may create and drop a scratch
database (the tests' variables work):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/15 \
        .venv/bin/python bench/scrape/scrape_bench.py

Results go to bench/scrape/results.json (see bench/README.md, section "Scraping").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from scratch import django_on_scratch_database, recreate_scratch_database  # noqa: E402  (bench/scratch.py)

RECORDED_PAGE = HERE / "vllm-0.32-cpu-metrics.txt"
SCRATCH_DB = "inferops_bench_scrape"

# What one request to a stub adds (as if the replica served one more chat request in between):
# counter increments, and histogram observations as (value, how many).
COUNTER_STEPS = {
    "vllm:prompt_tokens_total": 40,
    "vllm:generation_tokens_total": 25,
    "vllm:prefix_cache_queries_total": 40,
    "vllm:prefix_cache_hits_total": 16,
}
REQUEST_REASON_STEP = ("stop", 1)
HISTOGRAM_STEPS = {
    "vllm:time_to_first_token_seconds": (0.05, 1),
    "vllm:inter_token_latency_seconds": (0.02, 24),
    "vllm:e2e_request_latency_seconds": (0.6, 1),
}
_SAMPLE = re.compile(r"^(?P<name>[^{ ]+)(?P<labels>\{[^}]*\})? (?P<value>\S+)$")
_LE = re.compile(r'le="([^"]+)"')


class StubPage:
    """The recorded page as a template whose moving values are recomputed per request."""

    def __init__(self, text: str) -> None:
        self.parts: list[str | tuple[str, float, float]] = []  # text, or (prefix, base, step)
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            step = self._step(match) if match and not line.startswith("#") else 0.0
            if step:
                prefix = line[: match.start("value")]
                self.parts.append((prefix, float(match.group("value")), step))
            else:
                self.parts.append(line)

    @staticmethod
    def _step(match: re.Match) -> float:
        name, labels = match.group("name"), match.group("labels") or ""
        if name in COUNTER_STEPS:
            return COUNTER_STEPS[name]
        if name == "vllm:request_success_total":
            reason, step = REQUEST_REASON_STEP
            return step if f'finished_reason="{reason}"' in labels else 0.0
        for family, (value, count) in HISTOGRAM_STEPS.items():
            if name == f"{family}_bucket":
                return count if float(_LE.search(labels).group(1)) >= value else 0.0
            if name == f"{family}_count":
                return count
            if name == f"{family}_sum":
                return value * count
        return 0.0

    def render(self, tick: int) -> bytes:
        gauges = {"vllm:num_requests_running": tick % 4, "vllm:num_requests_waiting": tick % 3,
                  "vllm:kv_cache_usage_perc": (tick % 10) / 10}
        lines = []
        for part in self.parts:
            if isinstance(part, tuple):
                prefix, base, step = part
                lines.append(f"{prefix}{base + step * tick!r}")
            else:
                name = part.split("{", 1)[0]
                if name in gauges and not part.startswith("#"):
                    part = f"{part.rsplit(' ', 1)[0]} {float(gauges[name])!r}"
                lines.append(part)
        return ("\n".join(lines) + "\n").encode()


def serve_stubs(count: int, ports_out, stop_event, delay_s) -> None:
    """Child process: `count` HTTP servers on loopback, one asyncio loop, until stopped.
    Each answers after `delay_s.value` seconds (a shared value the parent can change)."""
    page = StubPage(RECORDED_PAGE.read_text())

    async def main() -> None:
        servers, ports = [], []
        for _ in range(count):
            ticks = {"n": 0}

            async def handle(reader, writer, ticks=ticks):
                try:
                    await reader.readuntil(b"\r\n\r\n")
                    if delay_s.value:
                        await asyncio.sleep(delay_s.value)
                    ticks["n"] += 1
                    body = page.render(ticks["n"])
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
                    writer.write(body)
                    await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
            servers.append(server)
            ports.append(server.sockets[0].getsockname()[1])
        ports_out.send(ports)
        while not stop_event.is_set():
            await asyncio.sleep(0.2)

    asyncio.run(main())




def make_replicas(urls: list[str]):
    from deployments.choices import ReplicaState
    from deployments.models import Deployment, Replica
    from registry.models import ModelVersion, RegisteredModel

    model = RegisteredModel.objects.create(name="bench-tiny", task="generate")
    version = ModelVersion.objects.create(
        model=model, number=1, artifact_uri="/nonexistent/bench", digest="0" * 64, manifest=[],
        architecture="LlamaForCausalLM", parameter_count=1, hidden_size=64, num_layers=2,
        num_attention_heads=4, num_kv_heads=2, head_dim=16, vocab_size=320, max_context=512,
        dtype="float32", weight_bytes=1, kv_cache_bytes_per_token=1, has_tokenizer=True,
        has_chat_template=True)
    deployment = Deployment.objects.create(name="bench", model=model, version=version,
                                           replicas=len(urls))
    return Replica.objects.bulk_create([
        Replica(deployment=deployment, version=version, node="bench", url=url,
                state=ReplicaState.READY)
        for url in urls])


def naive_cycle(replicas) -> dict:
    """The peer: fetch one replica after the other with `requests`, store each on arrival."""
    import requests
    from django.utils import timezone

    from deployments.replicas.scraping import MetricsParseError, ScrapeResult, parse_metrics, store_results

    began = time.perf_counter()
    failed = 0
    for replica in replicas:
        scraped_at = timezone.now()
        try:
            response = requests.get(f"{replica.url}/metrics", timeout=(2.0, 5.0))
            response.raise_for_status()
            result = ScrapeResult(replica.pk, scraped_at, sample=parse_metrics(response.text))
        except (requests.RequestException, MetricsParseError) as error:
            result = ScrapeResult(replica.pk, scraped_at, error=str(error))
            failed += 1
        store_results([result])
    return {"wall_s": time.perf_counter() - began, "failed": failed}


def concurrent_cycle() -> dict:
    from deployments.replicas.scraping import scrape_cycle

    began = time.perf_counter()
    report = scrape_cycle()
    wall = time.perf_counter() - began
    assert not report.skipped
    return {"wall_s": wall, "fetch_s": report.fetch_s, "store_s": report.store_s,
            "failed": report.store.failed, "stored": report.store.stored}


def summary(cycles: list[dict]) -> dict:
    walls = [cycle["wall_s"] for cycle in cycles]
    return {"cycles": len(cycles), "wall_p50_s": round(statistics.median(walls), 3),
            "wall_max_s": round(max(walls), 3), "wall_min_s": round(min(walls), 3),
            "per_cycle": [{key: round(value, 3) if isinstance(value, float) else value
                           for key, value in cycle.items()} for cycle in cycles]}


def stored_generation_tokens() -> int:
    from django.db.models import Sum

    from deployments.models import ReplicaMetricsMinute

    return ReplicaMetricsMinute.objects.aggregate(total=Sum("generation_tokens"))["total"] or 0


def raw_generation_tokens() -> float:
    from deployments.models import Replica

    return sum(state.get("counters", {}).get("generation_tokens", 0.0)
               for state in Replica.objects.values_list("scrape_state", flat=True))


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    admin_url = django_on_scratch_database(SCRATCH_DB)
    # httpx logs every request at INFO: 200 lines a cycle would drown the figures.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)

    # A separate process, so serving the stubs never runs inside the scraper's event loop.
    spawn = multiprocessing.get_context("spawn")
    ports_in, ports_out = spawn.Pipe(duplex=False)
    stop = spawn.Event()
    delay_s = spawn.Value("d", 0.0)
    stubs = spawn.Process(target=serve_stubs, args=(args.replicas, ports_out, stop, delay_s))
    stubs.start()
    try:
        ports = ports_in.recv()
        replicas = make_replicas([f"http://127.0.0.1:{port}" for port in ports])
        concurrent_cycle()  # baselines: the first scrape of a replica stores no deltas
        baseline = raw_generation_tokens()
        concurrent = [concurrent_cycle() for _ in range(args.cycles)]
        naive = [naive_cycle(replicas) for _ in range(args.naive_cycles)]
        concurrent += [concurrent_cycle() for _ in range(args.cycles)]
        stored, raw = stored_generation_tokens(), raw_generation_tokens()

        delay_s.value = args.busy_delay_ms / 1000
        busy_concurrent = [concurrent_cycle() for _ in range(3)]
        busy_naive = [naive_cycle(replicas)]
        delay_s.value = 0.0

        dead_ports, hanging = [], []
        for _ in range(3):
            with socket.socket() as probe:  # bound then closed: nothing listens there
                probe.bind(("127.0.0.1", 0))
                dead_ports.append(probe.getsockname()[1])
        for _ in range(2):
            listener = socket.socket()  # the kernel accepts the connection; nobody answers
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            hanging.append(listener)
        bad_urls = [f"http://127.0.0.1:{port}" for port in dead_ports] + [
            f"http://127.0.0.1:{listener.getsockname()[1]}" for listener in hanging]
        replicas_with_faults = list(replicas) + make_faulty_replicas(replicas[0], bad_urls)
        # The first cycle meets the faulty replicas last (highest ids); later cycles start with
        # them (ready_targets puts last cycle's failures first).
        faults_concurrent = [concurrent_cycle() for _ in range(3)]
        faults_naive = [naive_cycle(replicas_with_faults)]
        for listener in hanging:
            listener.close()
    finally:
        stop.set()
        stubs.join(timeout=10)
        connection.close()
        recreate_scratch_database(admin_url, SCRATCH_DB, drop_only=True)

    concurrent_summary, naive_summary = summary(concurrent), summary(naive)
    return {
        "benchmark": "scrape cycle: fetch /metrics of every ready replica, store into Postgres",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # Other work on the machine shows here; a busy machine slows both sides alike.
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(),
                    "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}},
        "replicas": args.replicas,
        "page_bytes": len(StubPage(RECORDED_PAGE.read_text()).render(1)),
        "scraper": {"name": "deployments.replicas.scraping.scrape_cycle",
                    "concurrency": 32, "timeouts_s": {"connect": 2.0, "total": 5.0},
                    **concurrent_summary},
        "peer": {"name": "naive sequential: requests.get one by one, each stored on arrival",
                 **naive_summary},
        "speedup_p50": round(naive_summary["wall_p50_s"] / concurrent_summary["wall_p50_s"], 1),
        "deltas_verified": {"stored_generation_tokens": stored,
                            "raw_increase_since_baseline": raw - baseline,
                            "equal": stored == raw - baseline},
        "busy_replicas": {
            "answer_delay_ms": args.busy_delay_ms,
            "scraper": summary(busy_concurrent), "peer": summary(busy_naive)},
        "with_faults": {
            "replicas": len(replicas_with_faults), "dead": 3, "hanging": 2,
            "scraper": summary(faults_concurrent), "peer": summary(faults_naive)},
    }


def make_faulty_replicas(template, urls: list[str]):
    from deployments.models import Replica

    return Replica.objects.bulk_create([
        Replica(deployment_id=template.deployment_id, version_id=template.version_id,
                node="bench", url=url, state=template.state) for url in urls])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=5,
                        help="concurrent cycles before and after the naive ones (each)")
    parser.add_argument("--naive-cycles", type=int, default=3)
    parser.add_argument("--busy-delay-ms", type=float, default=50.0,
                        help="server-side delay of every answer in the busy-replicas scenario")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args()
    results = run(args)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({key: results[key] for key in ("replicas", "speedup_p50", "deltas_verified")}
                     | {"scraper_p50_s": results["scraper"]["wall_p50_s"],
                        "scraper_max_s": results["scraper"]["wall_max_s"],
                        "peer_p50_s": results["peer"]["wall_p50_s"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
