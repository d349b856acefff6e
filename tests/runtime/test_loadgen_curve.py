"""`inferops bench --rates`: a goodput curve, one step per rate, against a small in-process responder that
serves two requests at a time (a stand-in for a replica's batch): below its capacity the steps keep up,
above it requests queue and TTFT p95 grows."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from runtime.loadgen import BenchConfig, BenchConfigError, LengthRange, format_curve, parse_rates, run_curve
from tests.waiting import wait_until

SLOTS = 2
TTFT_S = 0.02
TOKEN_GAP_S = 0.005
OUTPUT_TOKENS = 4
# Two slots, each held ~35 ms a request (TTFT then three gaps): about 57 req/s at most.
CAPACITY_RPS = SLOTS / (TTFT_S + (OUTPUT_TOKENS - 1) * TOKEN_GAP_S)


class SlotResponder:
    """Streams `max_tokens` chunks for at most SLOTS requests at once; the others wait for a slot."""

    def __init__(self):
        self.payloads: list[dict] = []
        self.slots: asyncio.Semaphore | None = None

    async def handle(self, request: Request):
        payload = await request.json()
        self.payloads.append(payload)
        self.slots = self.slots or asyncio.Semaphore(SLOTS)
        return StreamingResponse(self.events(payload), media_type="text/event-stream")

    async def events(self, payload: dict):
        async with self.slots:
            await asyncio.sleep(TTFT_S)
            for index in range(payload["max_tokens"]):
                if index:
                    await asyncio.sleep(TOKEN_GAP_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{index}'}]})}\n\n"
            usage = {"prompt_tokens": len(payload["prompt"].split()), "completion_tokens": payload["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"


@pytest.fixture(scope="session")
def slot_server():
    responder = SlotResponder()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/completions", responder.handle,
                                                                   methods=["POST"])]), log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the responder to start", 10, 0.02)
    yield responder, f"http://127.0.0.1:{port}"
    server.should_exit = True


def config(base_url: str, **fields) -> BenchConfig:
    return BenchConfig(base_url=base_url, model="fake", input_len=LengthRange(8, 8),
                       output_len=LengthRange(OUTPUT_TOKENS, OUTPUT_TOKENS), show_progress=False, **fields)


def test_one_step_per_rate_with_its_requests_and_latency_growing_past_capacity(slot_server):
    responder, base_url = slot_server
    responder.payloads.clear()
    rates = [10.0, 4 * CAPACITY_RPS]  # well under, then four times over
    started = time.monotonic()
    points = run_curve(config(base_url, goodput_slos_ms={"ttft": 150.0}, priority=-1000), rates, step_s=1.0)
    assert [point["rps"] for point in points] == rates
    assert [point["completed"] for point in points] == [10, round(4 * CAPACITY_RPS)]
    assert all(point["failed"] == 0 for point in points)
    assert set(points[0]) == {"rps", "throughput_rps", "goodput_rps", "ttft_p95_ms", "tpot_p95_ms", "completed",
                              "failed", "sent_rps"}
    # 10 Poisson arrivals at 10 req/s: the rate really sent strays from 10, by up to about half either way.
    assert 4 < points[0]["sent_rps"] < 30
    under, over = points
    # Four times the capacity cannot drain in the step: requests queue for a slot, throughput stops at the capacity.
    assert over["ttft_p95_ms"] > 3 * under["ttft_p95_ms"]
    assert over["throughput_rps"] < 0.8 * over["rps"]
    assert under["goodput_rps"] == pytest.approx(under["throughput_rps"])
    assert over["goodput_rps"] < over["throughput_rps"]  # the queued ones waited past 150 ms for their first token
    assert under["tpot_p95_ms"] == pytest.approx(TOKEN_GAP_S * 1000, rel=0.8)
    # Every request carried the priority; each step drew prompts of its own (no step replays the last's).
    assert {payload["priority"] for payload in responder.payloads} == {-1000}
    first_step = {payload["prompt"] for payload in responder.payloads[:10]}
    assert not first_step & {payload["prompt"] for payload in responder.payloads[10:]}
    print(f"curve in {time.monotonic() - started:.1f}s:\n{format_curve(points)}")


def test_a_step_where_nothing_completes_has_no_latency_rather_than_zero():
    points = run_curve(config("http://127.0.0.1:9", timeout_s=2), [5.0], step_s=0.4)
    assert points[0]["completed"] == 0 and points[0]["failed"] == 2
    assert points[0]["ttft_p95_ms"] is None and points[0]["tpot_p95_ms"] is None


@pytest.mark.parametrize(("rates", "step_s", "says"), [
    ([], 1.0, "at least one"),
    ([2.0, 1.0], 1.0, "must rise"),
    ([1.0, 1.0], 1.0, "must rise"),
    ([0.0, 1.0], 1.0, "> 0"),
    ([float("inf")], 1.0, "finite"),
    ([float(rate) for rate in range(1, 60)], 1.0, "at most 50 steps"),
    ([1.0], 0.0, "step-seconds"),
    ([1.0], float("nan"), "step-seconds"),
])
def test_bad_curves_name_the_option(rates, step_s, says):
    with pytest.raises(BenchConfigError, match=says):
        run_curve(config("http://127.0.0.1:9"), rates, step_s)


def test_rates_parse_from_the_command_line():
    assert parse_rates("1,2, 4,8") == [1.0, 2.0, 4.0, 8.0]
    with pytest.raises(BenchConfigError, match="rates='1,two'"):
        parse_rates("1,two")


def test_the_cli_prints_the_curve_and_writes_it_to_result_json(slot_server, tmp_path, capsys):
    from project.cli import main

    _, base_url = slot_server
    result = tmp_path / "curve.json"
    argv = ["bench", "--base-url", base_url, "--model", "fake", "--input-len", "8", "--output-len", "3",
            "--request-rates", "5,10", "--step-seconds", "0.6", "--goodput", "ttft:1000", "--result-json", str(result)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Goodput Curve" in out and "offered req/s" in out and "TTFT p95 ms" in out
    saved = json.loads(result.read_text())
    assert saved["rates"] == [5.0, 10.0] and saved["step_s"] == 0.6
    assert [point["completed"] for point in saved["points"]] == [3, 6]
    assert saved["config"]["goodput_slos_ms"] == {"ttft": 1000.0}


def test_save_curve_needs_rates(slot_server):
    from project.cli import main

    _, base_url = slot_server
    with pytest.raises(SystemExit, match="--save-curve stores a curve: give --rates"):
        main(["bench", "--base-url", base_url, "--model", "fake", "--save-curve", "chat"])
