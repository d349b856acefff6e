"""Conventions at the edges of the data plane: X-Request-Id, W3C traceparent, OpenAI's
x-ratelimit-* headers, keys looked up in Redis, the replica's Server-Timing, JSON log lines.

Gateways and replicas are the suite's (tests/gateway/conftest.py) over a real Redis; one test
runs a real replica process with JSON logs."""

from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request

from runtime.engine.server.routes import server_timing as replica_server_timing
from runtime.gateway import jsonlog
from runtime.gateway.contract import KEYS_KEY, hash_api_key
from runtime.gateway.limits import openai_duration
from runtime.gateway.server import client_request_id, server_timing, trace_headers
from tests.conftest import free_port
from tests.gateway.conftest import REDIS_URL, FakeReplica
from tests.services import Process
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HTTP = httpx.Client(timeout=20)
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _auth(secret: str, **headers: str | bytes) -> dict:
    return {"Authorization": f"Bearer {secret}", **headers}


def _chat(content: str = "hi", **extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


class RecordingReplica(FakeReplica):
    """The suite's fake replica, also keeping each request's headers and sending `server_timing`
    (as `inferops serve` does) on whole answers when set."""

    def __init__(self, replica_id: int) -> None:
        super().__init__(replica_id)
        self.headers: list[dict[str, str]] = []
        self.server_timing: str | None = None

    async def generate(self, request: Request):
        self.headers.append(dict(request.headers))
        response = await super().generate(request)
        if self.server_timing is not None and response.media_type == "application/json":
            response.headers["server-timing"] = self.server_timing
        return response


@pytest.fixture
def edge(control, gateways):
    """Deployment `demo` on one recording replica, an unlimited key, one gateway."""
    replica = RecordingReplica(1)
    replica.server.start()
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, _ = control.publish_key("acme", ["demo"])
    _, base_url = gateways()
    yield replica, secret, base_url
    replica.server.stop()


# -- X-Request-Id ------------------------------------------------------------------------------


@pytest.mark.parametrize("sent,usable", [
    (b"req-42", "req-42"), (b"  padded  ", "padded"), (b"x" * 128, "x" * 128),
    (b"a b:c/d=e", "a b:c/d=e"),
    (None, None), (b"", None), (b"   ", None), (b"x" * 129, None), (b"tab\there", None), (b"nul\x00", None),
    (b"del\x7f", None), ("café".encode(), None),
])
def test_a_client_request_id_is_used_only_when_printable_and_at_most_128_characters(sent, usable):
    assert client_request_id(sent) == usable


def test_the_client_request_id_reaches_the_replica_and_comes_back_while_the_ledger_keeps_its_own(edge, control):
    replica, secret, base_url = edge
    answer = HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret, **{"X-Request-Id": "ord-7"}))
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "ord-7"
    assert replica.headers[-1]["x-request-id"] == "ord-7"

    stream = HTTP.post(f"{base_url}/chat/completions", json=_chat(stream=True),
                       headers=_auth(secret, **{"X-Request-Id": "ord-7"}))  # a client reusing its id
    assert stream.status_code == 200 and stream.headers["x-request-id"] == "ord-7"

    generated = HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret))
    own_id = generated.headers["x-request-id"]
    assert own_id.startswith("gw-") and replica.headers[-1]["x-request-id"] == own_id

    events = control.wait_events(3)
    assert [e["client_request_id"] for e in events] == ["ord-7", "ord-7", None]
    # The ledger's key stays the gateway's own, so a reused client id loses no usage.
    assert all(e["request_id"].startswith("gw-") for e in events)
    assert len({e["request_id"] for e in events}) == 3 and events[2]["request_id"] == own_id


@pytest.mark.parametrize("unusable", ["x" * 129, "tab\there", "café".encode()])
def test_an_unusable_client_request_id_is_replaced_by_a_generated_one(edge, control, unusable):
    replica, secret, base_url = edge
    answer = HTTP.post(f"{base_url}/chat/completions", json=_chat(),
                       headers=_auth(secret, **{"X-Request-Id": unusable}))
    assert answer.status_code == 200
    generated = answer.headers["x-request-id"]
    assert re.fullmatch(r"gw-[0-9a-f]{32}", generated) and replica.headers[-1]["x-request-id"] == generated
    (event,) = control.wait_events(1)
    assert (event["request_id"], event["client_request_id"]) == (generated, None)


def test_refusals_carry_the_request_id_too(edge, control):
    _, _, base_url = edge
    refused = HTTP.post(f"{base_url}/chat/completions", json=_chat(),
                        headers=_auth("iop_nope_nope", **{"X-Request-Id": "who-am-i"}))
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "who-am-i"
    (event,) = control.wait_events(1)
    assert (event["status"], event["client_request_id"]) == (401, "who-am-i")


# -- traceparent ---------------------------------------------------------------------------------


def _scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"headers": list(headers)}


@pytest.mark.parametrize("parent,passed", [
    (TRACEPARENT, True),
    (f"00-{TRACE_ID}-{PARENT_ID}-00", True),
    (f"cc-{TRACE_ID}-{PARENT_ID}-01-what-a-later-version-adds", True),  # later versions may append fields
    (f"cc-{TRACE_ID}-{PARENT_ID}-01", True),
    (f"00-{TRACE_ID}-{PARENT_ID}-01-extra", False),  # version 00 has exactly four fields
    (f"cc-{TRACE_ID}-{PARENT_ID}-01x", False),
    (f"ff-{TRACE_ID}-{PARENT_ID}-01", False),  # version ff is invalid
    (f"00-{'0' * 32}-{PARENT_ID}-01", False),  # all-zero trace id
    (f"00-{TRACE_ID}-{'0' * 16}-01", False),  # all-zero parent id
    (f"00-{TRACE_ID.upper()}-{PARENT_ID}-01", False),  # lowercase hex only
    (f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01", False),
    (f"00_{TRACE_ID}_{PARENT_ID}_01", False),
    ("", False),
])
def test_only_a_well_formed_traceparent_is_passed_on(parent, passed):
    headers = trace_headers(_scope((b"traceparent", parent.encode()), (b"tracestate", b"congo=t61rcWkgMzE")))
    assert headers == ({"traceparent": parent, "tracestate": "congo=t61rcWkgMzE"} if passed else {})


def test_tracestate_is_passed_on_only_beside_a_valid_traceparent_and_when_sane():
    parent = (b"traceparent", TRACEPARENT.encode())
    assert trace_headers(_scope((b"tracestate", b"congo=t61rcWkgMzE"))) == {}
    assert trace_headers(_scope(parent)) == {"traceparent": TRACEPARENT}
    # Several tracestate headers are one list.
    assert trace_headers(_scope(parent, (b"tracestate", b"a=1"), (b"tracestate", b"b=2")))["tracestate"] == "a=1,b=2"
    for bad in (b"a=1\x01", b"a=" + b"x" * 600):
        assert trace_headers(_scope(parent, (b"tracestate", bad))) == {"traceparent": TRACEPARENT}


def test_traceparent_reaches_the_replica_unchanged_and_an_invalid_one_does_not(edge):
    replica, secret, base_url = edge
    traced = {"traceparent": TRACEPARENT, "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"}
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret, **traced)).status_code == 200
    seen = replica.headers[-1]
    assert (seen["traceparent"], seen["tracestate"]) == (traced["traceparent"], traced["tracestate"])

    stream = HTTP.post(f"{base_url}/chat/completions", json=_chat(stream=True), headers=_auth(secret, **traced))
    assert stream.status_code == 200 and replica.headers[-1]["traceparent"] == TRACEPARENT

    broken = {"traceparent": f"00-{'0' * 32}-{PARENT_ID}-01", "tracestate": "congo=t61rcWkgMzE"}
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret, **broken)).status_code == 200
    assert "traceparent" not in replica.headers[-1] and "tracestate" not in replica.headers[-1]


# -- x-ratelimit-* -------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (-3, "0s"), (0.0004, "0s"), (0.001, "1ms"), (0.02, "20ms"), (0.9994, "999ms"), (0.9996, "1s"),
    (1, "1s"), (1.5, "1.5s"), (12.345, "12.345s"), (59.9996, "1m0s"), (60, "1m0s"), (61.25, "1m1.25s"),
    (360, "6m0s"), (3600, "1h0m0s"), (3723.5, "1h2m3.5s"),
])
def test_openai_duration_writes_durations_as_openai_does(seconds, text):
    assert openai_duration(seconds) == text


def _seconds(duration: str) -> float:
    """Back from openai_duration's format (Go's), to check header values."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)(ms|s))?", duration)
    assert match and duration, f"not a Go duration: {duration!r}"
    hours, minutes, number, unit = match.groups()
    value = float(number or 0) / (1000 if unit == "ms" else 1)
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + value


def _ratelimit(response: httpx.Response) -> dict[str, str]:
    return {name.removeprefix("x-ratelimit-"): value for name, value in response.headers.items()
            if name.startswith("x-ratelimit-")}


def _clear_of_the_window_edge(control) -> None:
    """The limits count in 60 s windows of Redis's clock: start a sequence of requests that
    expects one window early enough in it."""
    wait_until(lambda: control.redis.time()[0] % 60 < 50, "10 s clear of a window's end", timeout=15)


def test_ratelimit_headers_on_answers_and_on_a_429(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, _ = control.publish_key("acme", ["demo"], key_limits={"rpm": 3, "tpm": 1000})
    _, base_url = gateways()
    _clear_of_the_window_edge(control)

    answers = [HTTP.post(f"{base_url}/chat/completions", json=_chat("hi there"), headers=_auth(secret))
               for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    first = _ratelimit(answers[0])
    assert set(first) == {"limit-requests", "remaining-requests", "reset-requests",
                          "limit-tokens", "remaining-tokens", "reset-tokens"}
    # "hi there" is charged as 2 tokens on admission (characters / 4); the replica's count comes later.
    assert (first["limit-requests"], first["remaining-requests"], first["limit-tokens"],
            first["remaining-tokens"]) == ("3", "2", "1000", "998")
    assert 0 < _seconds(first["reset-requests"]) <= 60 and first["reset-tokens"] == first["reset-requests"]
    assert [_ratelimit(a)["remaining-requests"] for a in answers[1:3]] == ["1", "0"]

    refused = answers[3]
    # On a 429 the exhausted limit is the one reported, and its reset agrees with Retry-After.
    assert _ratelimit(refused) == {"limit-requests": "3", "remaining-requests": "0",
                                   "reset-requests": _ratelimit(refused)["reset-requests"]}
    reset_s = _seconds(_ratelimit(refused)["reset-requests"])
    assert 0 < reset_s <= 60 and int(refused.headers["retry-after"]) == pytest.approx(reset_s, abs=1)
    assert refused.json()["error"]["type"] == "RateLimitError"


def test_ratelimit_headers_report_the_scope_with_less_left_and_tokens_on_a_429(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    both, _ = control.publish_key(tenant, ["demo"], key_limits={"rpm": 50}, tenant_limits={"rpm": 5})
    tokens, _ = control.publish_key(f"{tenant}-tpm", ["demo"], tenant_limits={"tpm": 10})
    _, base_url = gateways()
    _clear_of_the_window_edge(control)

    answer = HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(both))
    assert answer.status_code == 200
    # The tenant's 5 leaves less than the key's 50; no tokens limit, so no tokens headers.
    assert {k: v for k, v in _ratelimit(answer).items() if not k.startswith("reset")} == {
        "limit-requests": "5", "remaining-requests": "4"}

    too_long = HTTP.post(f"{base_url}/chat/completions", json=_chat("x" * 80), headers=_auth(tokens))
    assert too_long.status_code == 429
    headers = _ratelimit(too_long)
    assert (headers["limit-tokens"], headers["remaining-tokens"]) == ("10", "0") and "limit-requests" not in headers
    assert 0 < _seconds(headers["reset-tokens"]) <= 60


# -- keys looked up in Redis -----------------------------------------------------------------------


def test_a_key_unknown_to_an_instance_works_at_once_and_its_revocation_reaches_it_within_5_s(edge, control, gateways):
    replica, _, first_url = edge
    second, second_url = gateways()
    # Written the way a publish starts, before any generation moved or message went out: no
    # instance's snapshot can know it, so only the Redis lookup can let it in.
    prefix = uuid.uuid4().hex[:8]
    secret = f"iop_{prefix}_{uuid.uuid4().hex}"
    record = {"prefix": prefix, "name": "fresh", "tenant": "acme", "deployments": ["demo"], "priority": 0,
              "expires_at": None, "limits": {"key": {}, "tenant": {}}}
    control.redis.hset(KEYS_KEY, hash_api_key(secret), json.dumps(record))
    assert hash_api_key(secret) not in second.state.snapshot.keys
    for base_url in (first_url, second_url):
        assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret)).status_code == 200
    assert [e["key_prefix"] for e in control.wait_events(2)] == [prefix, prefix]

    # Revoked with no announcement: the generation poll alone must stop it everywhere.
    control.revoke(secret, announce=False)

    def refused_everywhere() -> bool:
        return all(HTTP.post(f"{url}/chat/completions", json=_chat(), headers=_auth(secret)).status_code == 401
                   for url in (first_url, second_url))

    wait_until(refused_everywhere, "the revocation to reach both instances", timeout=5.0)  # the 5 s under test


# -- Server-Timing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("header,expected", [
    (None, (None, None)),
    (b"", (None, None)),
    (b"ttft;dur=12.5, tpot;dur=4", (12.5, 4.0)),
    (b"tpot;dur=4,ttft;dur=12.5", (12.5, 4.0)),
    (b"TTFT;DUR=3", (3.0, None)),
    (b" ttft ; dur = 3 , tpot ; dur = 0 ", (3.0, 0.0)),
    (b'ttft;desc="first token";dur="7.25"', (7.25, None)),
    (b"cache;desc=hit, db;dur=53, ttft;dur=2", (2.0, None)),
    (b"ttft;dur=1, ttft;dur=2", (1.0, None)),  # the first of a name counts
    (b"ttft;dur=5;dur=9", (5.0, None)),
    (b"ttft", (None, None)),
    (b"ttft;dur", (None, None)),
    (b"ttft;dur=", (None, None)),
    (b"ttft;dur=abc, tpot;dur=2", (None, 2.0)),
    (b"ttft;dur=-1", (None, None)),
    (b"ttft;dur=inf", (None, None)),
    (b"ttft;dur=nan", (None, None)),
    (b"ttft;dur=1e999", (None, None)),
    (b"ttftx;dur=5, xttft;dur=6", (None, None)),
    (b",,;;==,;dur=3", (None, None)),
    (b"\xff\xfe;dur=1", (None, None)),
])
def test_server_timing_reads_ttft_and_tpot_and_ignores_the_rest(header, expected):
    assert server_timing(header) == expected


def test_the_replicas_server_timing_reads_back_through_the_gateways_parser():
    timer = SimpleNamespace(arrived_at=10.0, first_token_at=10.0125, last_token_at=10.0225, num_output_tokens=5)
    header = replica_server_timing(timer)
    assert header == "ttft;dur=12.500, tpot;dur=2.500"
    assert server_timing(header.encode()) == (12.5, 2.5)
    # One token has no TPOT; no token (a refusal, a cut) sends no header at all.
    one = SimpleNamespace(arrived_at=10.0, first_token_at=10.5, last_token_at=10.5, num_output_tokens=1)
    assert server_timing(replica_server_timing(one).encode()) == (500.0, None)
    assert replica_server_timing(SimpleNamespace(arrived_at=10.0, first_token_at=None, last_token_at=None,
                                                 num_output_tokens=0)) is None


def test_ttft_is_the_replicas_for_a_whole_answer_the_gateways_for_a_stream_and_absent_without_a_header(
        edge, control):
    replica, secret, base_url = edge
    replica.server_timing = "ttft;dur=12.5, tpot;dur=3.25"
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret)).status_code == 200
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat(stream=True), headers=_auth(secret)).status_code == 200
    replica.server_timing = None  # a vLLM replica sends no Server-Timing
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret)).status_code == 200
    whole, stream, bare = control.wait_events(3)
    assert (whole["stream"], whole["ttft_ms"], whole["tpot_ms"], whole["ttft_source"]) == (False, 12.5, 3.25, "server")
    assert stream["stream"] and stream["ttft_source"] == "gateway" and 0 < stream["ttft_ms"] <= stream["e2e_ms"]
    assert (bare["ttft_ms"], bare["tpot_ms"], bare["ttft_source"]) == (None, None, None)


# -- JSON logs -------------------------------------------------------------------------------------------


@pytest.fixture
def root_logging():
    """Restores the root logger's handlers and level that configure() changes."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_json_line_is_one_object_with_the_request_id_of_its_request():
    formatter = jsonlog.JsonFormatter()
    record = logging.LogRecord("runtime.gateway.server", logging.WARNING, __file__, 1, "ejected %s\nnext line",
                               ("r-1",), None)
    token = jsonlog.REQUEST_ID.set("ord-7")
    try:
        line = formatter.format(record)
        try:
            raise ValueError("boom")
        except ValueError:
            failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
        failure = json.loads(formatter.format(failed))
    finally:
        jsonlog.REQUEST_ID.reset(token)
    assert "\n" not in line  # one line, whatever the message holds
    data = json.loads(line)
    assert set(data) == {"time", "level", "logger", "message", "request_id"}
    assert (data["level"], data["logger"], data["message"], data["request_id"]) == (
        "WARNING", "runtime.gateway.server", "ejected r-1\nnext line", "ord-7")
    assert data["time"].endswith("+00:00") and "T" in data["time"]
    assert failure["request_id"] == "ord-7" and "ValueError: boom" in failure["exception"]
    # Outside a request there is no request_id key at all.
    assert "request_id" not in json.loads(formatter.format(record))


def test_configure_twice_keeps_one_handler_and_follows_the_setting(root_logging, monkeypatch):
    other = logging.NullHandler()  # someone else's (pytest's own capture handlers are such)
    root_logging.addHandler(other)
    monkeypatch.setenv("INFEROPS_LOG_FORMAT", "json")
    assert jsonlog.configure("info") is True
    assert jsonlog.configure("warning") is True
    ours = [h for h in root_logging.handlers if getattr(h, "inferops_console", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, jsonlog.JsonFormatter)
    assert other in root_logging.handlers and root_logging.level == logging.WARNING
    monkeypatch.setenv("INFEROPS_LOG_FORMAT", "plain")
    assert jsonlog.configure("info") is False
    ours = [h for h in root_logging.handlers if getattr(h, "inferops_console", False)]
    assert len(ours) == 1 and not isinstance(ours[0].formatter, jsonlog.JsonFormatter)


def _json_lines(path: Path) -> list[dict]:
    """Every line of a process's output, each of which must be one JSON object."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(p, dict) and {"time", "level", "logger", "message"} <= set(p) for p in parsed), lines
    return parsed


@pytest.mark.timeout(180)
def test_json_logs_of_a_real_gateway_and_replica_carry_the_clients_request_id(
        tiny_llama_dir, control, tmp_path, monkeypatch):
    monkeypatch.setenv("INFEROPS_LOG_FORMAT", "json")
    replica_port, gateway_port, dead_port = free_port(), free_port(), free_port()
    replica = Process(["serve", "--model", str(tiny_llama_dir), "--port", str(replica_port),
                       "--served-model-name", "demo", "--max-model-len", "256", "--cpu-threads", "1",
                       "--log-level", "info"], tmp_path / "replica.log", f"http://127.0.0.1:{replica_port}/health")
    gateway = Process(["gateway", "--port", str(gateway_port), "--redis-url", REDIS_URL, "--instance", "edge-json",
                       "--spool-dir", str(tmp_path / "spool"), "--log-level", "info"],
                      tmp_path / "gateway.log", f"http://127.0.0.1:{gateway_port}/health")
    try:
        control.publish_route("demo", [(1, 100, [(7, f"http://127.0.0.1:{replica_port}")])])
        control.publish_route("gone", [(1, 100, [(8, f"http://127.0.0.1:{dead_port}")])])
        secret, _ = control.publish_key("acme")
        gateway.wait_healthy(30)
        replica.wait_healthy()
        base_url = f"http://127.0.0.1:{gateway_port}/v1"
        answer = HTTP.post(f"{base_url}/chat/completions", headers=_auth(secret, **{"X-Request-Id": "ord-json-1"}),
                           json=_chat(max_tokens=3, ignore_eos=True))
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "ord-json-1"
        # Three failed connects eject the dead replica; the warning is logged inside the third request.
        for attempt in range(3):
            failed = HTTP.post(f"{base_url}/chat/completions", json=_chat(model="gone"),
                               headers=_auth(secret, **{"X-Request-Id": f"ord-gone-{attempt}"}))
            assert failed.status_code == 502
        (event, *_) = control.wait_events(4)
        assert (event["client_request_id"], event["ttft_source"]) == ("ord-json-1", "server")

        def logged(process: Process, request_id: str) -> list[dict]:
            return [line for line in _json_lines(process.log_path) if line.get("request_id") == request_id]

        wait_until(lambda: logged(replica, "ord-json-1") and logged(gateway, "ord-gone-2"), "both access lines logged",
                   timeout=5)
        (access, *_) = logged(replica, "ord-json-1")
        assert access["logger"] == "uvicorn.access" and "/v1/chat/completions" in access["message"]
        (ejected,) = logged(gateway, "ord-gone-2")
        assert ejected["level"] == "WARNING" and "ejected replica" in ejected["message"]
        assert any("gateway edge-json" in line["message"] for line in _json_lines(gateway.log_path))
    finally:
        gateway.stop()
        replica.stop()
