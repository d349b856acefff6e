"""The plan checked against reality: a real replica of the tiny Llama, measured by a capacity run (the
task's function, called here), planned for a rate that one replica serves, that rate run against it, the
SLOs held; then twice the rate planned, and the replicas grow.

Why these numbers. The replica runs with `max_num_seqs` 1: one request at a time, so its capacity is
1 / (its service time S), and requests queue as the rate nears it (an M/D/1 queue). S is measured first
(the median end-to-end time of a few requests one after another, 64 output tokens: ~65 ms on a 2-core CI
machine) and the SLO and the steps are set from it, so the test means the same on a CPU twice as fast or
as slow: TTFT p95 within 5 S, TPOT p95 within 100 ms (a token takes 1-2 ms here: only a broken replica
misses it), for 95 % of requests. The capacity run steps through 0.2 to 1.2 of 1 / S, 5 s each (the API's
shortest; ~30 s in all); at 1.2 the queue grows without bound, so the curve always reaches the limit.
A queue's p95 over a few seconds of Poisson arrivals is noisy (simulated: at 0.8 of capacity a 5 s step's
TTFT p95 wait lies anywhere from 2 to 7 S), so the curve puts the 5 S limit somewhere between 0.75 and
0.95 of 1 / S. The check runs 0.6 of what the plan gives one replica (capacity × (1 − 20 % headroom)),
the least that still makes twice the rate need a second replica: under half of 1 / S, where even the
99th-percentile 15 s window's TTFT p95 wait stays under 4 S.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capacity import runs, tasks
from capacity.planner import plan_for_deployment
from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from deployments.replicas.reconcile import reconcile_deployment
from registry import services as registry_services
from runtime.loadgen import BenchConfig, LengthRange, run_benchmark
from slo.services import slo_create
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

ENGINE_ARGS = {"cpu_threads": 1, "max_num_seqs": 1}
TTFT_SERVICE_TIMES, TPOT_MS, OBJECTIVE = 5, 100.0, 0.95
RATE_SHARES, STEP_S = (0.2, 0.4, 0.6, 0.8, 1.2), 5.0
INPUT_LEN, OUTPUT_LEN = 16, 64
HEADROOM = 0.2
CHECK_S = 15


def busy(url: str) -> float:
    """Requests running or waiting on the replica (its vLLM-named gauges)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
               for sample in family.samples)


def load(url: str, tokenizer, rate: float, count: int, ttft_ms: float, concurrency: int | None = None) -> dict:
    return run_benchmark(BenchConfig(
        base_url=url, model="chat", num_prompts=count, request_rate=rate, max_concurrency=concurrency,
        input_len=LengthRange(INPUT_LEN, INPUT_LEN), output_len=LengthRange(OUTPUT_LEN, OUTPUT_LEN),
        goodput_slos_ms={"ttft": ttft_ms, "tpot": TPOT_MS}, tokenizer_dir=str(tokenizer), seed=42,
        show_progress=False))


def test_n_replicas_planned_for_a_rate_hold_the_slo_at_that_rate_and_twice_the_rate_needs_more(
        settings, tmp_path, make_user, tiny_llama_dir, monkeypatch):
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.5, "backoff_base_s": 0.2,
                                           "health_timeout_s": 1, "drain_timeout_s": 20}
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    chat = deployment_services.deployment_create(name="chat", model=model, version=1, actor=actor,
                                                 engine_args=ENGINE_ARGS)
    monkeypatch.setattr(runs, "enqueue", lambda name, run_id: None)  # the task runs here, not on a worker
    started = time.monotonic()
    try:
        def ready():
            reconcile_deployment(chat.pk)
            return Replica.objects.filter(deployment=chat, state=ReplicaState.READY).first()

        replica = wait_until(ready, "the replica to be ready", 120, 0.3)
        service_s = load(replica.url, tiny_llama_dir, float("inf"), 6, 1e6, concurrency=1)["median_e2el_ms"] / 1000
        ttft_ms = TTFT_SERVICE_TIMES * service_s * 1000
        slo_create(actor=actor, name="chat-latency", deployment=chat, sli_kind="latency", ttft_ms=ttft_ms,
                   tpot_ms=TPOT_MS, objective=OBJECTIVE)
        rates = [round(share / service_s, 2) for share in RATE_SHARES]

        run = runs.capacity_run_create(deployment=chat, actor=actor, rates=rates, step_s=STEP_S, input_len=INPUT_LEN,
                                       output_len=OUTPUT_LEN)
        assert tasks.execute_capacity_run(run.pk) == "succeeded"
        run.refresh_from_db()
        points = run.curve.points
        print(f"curve after {time.monotonic() - started:.0f}s: " + ", ".join(
            f"{p['rps']:g} req/s: TTFT p95 {p['ttft_p95_ms'] or 0:.0f} ms, {p['completed']} done {p['failed']} failed"
            for p in points))
        # Latency rises with the rate, and the curve reaches the SLO's limit within its rates.
        assert points[-1]["failed"] or points[-1]["ttft_p95_ms"] > 3 * points[0]["ttft_p95_ms"]
        capacity = plan_for_deployment(chat, 1.0, HEADROOM)
        assert capacity["limited_by"] is not None, capacity["warnings"]
        per_replica = capacity["capacity_rps_per_replica"]
        assert rates[0] < per_replica < rates[-1]

        rate = per_replica * (1 - HEADROOM) * 0.6
        plan = plan_for_deployment(chat, rate, HEADROOM)
        assert plan["replicas"] == 1 and plan["curve"]["id"] == run.curve_id

        # Reality: that rate for CHECK_S seconds against the one replica, once the run's last requests are gone.
        wait_until(lambda: busy(replica.url) == 0, "the replica to finish the capacity run's requests", 30, 0.2)
        seen = load(replica.url, tiny_llama_dir, rate, round(rate * CHECK_S), ttft_ms)
        print(f"service time {service_s * 1000:.0f} ms; at {rate:.2f} req/s (capacity {per_replica:.2f}): "
              f"TTFT p95 {seen['p95_ttft_ms']:.0f} ms (SLO {ttft_ms:.0f}), TPOT p95 "
              f"{seen['p95_tpot_ms']:.1f} ms, goodput {seen['request_goodput']:.2f} of "
              f"{seen['request_throughput']:.2f} req/s, after {time.monotonic() - started:.0f}s")
        assert seen["failed"] == 0 and seen["completed"] == round(rate * CHECK_S)
        assert seen["p95_ttft_ms"] <= ttft_ms and seen["p95_tpot_ms"] <= TPOT_MS
        assert seen["good_requests"] >= OBJECTIVE * seen["completed"]

        twice = plan_for_deployment(chat, 2 * rate, HEADROOM)
        assert twice["replicas"] > plan["replicas"]
        assert twice["usd_per_hour"] is None or twice["usd_per_hour"] > plan["usd_per_hour"]
    finally:
        for leftover in Replica.objects.filter(deployment=chat):
            LocalProcessDriver().kill(leftover)
