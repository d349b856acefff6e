"""The OpenAI endpoints under hostile input (issue 40): tests/reliability/openai_fuzz.py's case
families against a real replica process (the tiny checkpoint) and a real gateway process in
front of it, with the key and route published into Redis as the control plane does.

Every case must get a 4xx with an OpenAI-style error body (a 2xx only where the case is a valid
request), or, when the request never arrives whole (slow-loris, a body announced and not
sent), be cut off by the server: both servers run with a 3 s read timeout here, and the bound
asserted is that timeout plus 5 s of slack, counted from the request's first byte (idle
connections: plus 10 s, as thousands are opened at once). Never a 5xx, never a hang, and a
well-formed request after every few cases, while slow clients hang on and after the idle
flood, must be served: all of them are counted.

The short pass (in `make test`) sends a few cases per family and opens 200 idle connections;
`make fuzz` (INFEROPS_RELIABILITY_LONG=1) sends thousands and opens 2,000, after raising this
process's soft file-descriptor limit (the servers, started after, inherit it). Figures go to
bench/reliability/results/openai_fuzz.json. The regression tests below are the defects the
fuzzer found, one each.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
import uuid

import httpx
import pytest

from runtime.gateway.contract import ROUTING_CHANNEL, ROUTING_GENERATION_KEY, ROUTING_KEY
from tests.conftest import free_port
from tests.gateway.conftest import REDIS_URL, Control
from tests.reliability.openai_fuzz import (
    CHAT,
    COMPLETIONS,
    FAMILIES,
    Case,
    Target,
    chat_body,
    completion_body,
    dumps,
    generate,
    http_request,
    idle_flood,
    openai_error,
    run,
    send_raw,
)
from tests.reliability.suite import record, scaled
from tests.services import Process
from tests.waiting import wait_until

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(scaled(300, 3600))]

SEED = 40
READ_TIMEOUT_S = 3.0
CUT_BOUND_S = READ_TIMEOUT_S + 5
IDLE_CONNECTIONS = scaled(200, 2000)
EVERY = scaled(5, 20)  # a well-formed request after this many cases
COUNTS = {name: scaled(3, 1000) for name in FAMILIES} | {
    "prompts": scaled(4, 60), "huge_bodies": scaled(3, 100), "bad_http": scaled(4, 400),
    "missing_body": scaled(3, 400), "deep_nesting": scaled(3, 400), "trickled": scaled(2, 200)}
FIGURES: dict = {"seed": SEED, "read_timeout_s": READ_TIMEOUT_S, "cut_off_bound_s": CUT_BOUND_S,
                 "idle_connections": IDLE_CONNECTIONS, "well_formed_every": EVERY, "servers": {}}


def raise_fd_limit(needed: int) -> None:
    """Thousands of idle connections need as many descriptors here and in the servers."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard),
                                                    hard))


class Servers:
    def __init__(self, tmp_path, checkpoint) -> None:
        self.model = f"fuzz-{uuid.uuid4().hex[:8]}"
        self.control = Control(REDIS_URL)
        replica_port, gateway_port = free_port(), free_port()
        self.replica = Process(["serve", "--model", str(checkpoint), "--port", str(replica_port),
                                "--served-model-name", self.model, "--max-model-len", "256", "--cpu-threads", "1",
                                "--request-read-timeout", str(READ_TIMEOUT_S), "--log-level", "warning"],
                               tmp_path / "replica.log", f"http://127.0.0.1:{replica_port}/health")
        self.gateway = Process(["gateway", "--port", str(gateway_port), "--redis-url", REDIS_URL,
                                "--instance", self.model, "--spool-dir", str(tmp_path / "spool"),
                                "--request-read-timeout", str(READ_TIMEOUT_S), "--log-level", "warning"],
                               tmp_path / "gateway.log", f"http://127.0.0.1:{gateway_port}/health")
        self.control.publish_route(self.model, [(1, 100, [(1, f"http://127.0.0.1:{replica_port}")])])
        self.secret, _ = self.control.publish_key("fuzz", [self.model])
        self.targets = {
            "replica": Target("replica", "127.0.0.1", replica_port, self.model, 4 * 2**20, READ_TIMEOUT_S),
            "gateway": Target("gateway", "127.0.0.1", gateway_port, self.model, 8 * 2**20, READ_TIMEOUT_S,
                              (("Authorization", f"Bearer {self.secret}"),)),
        }

    def wait_ready(self) -> None:
        self.gateway.wait_healthy(30)
        self.replica.wait_healthy()
        gateway = self.targets["gateway"]
        wait_until(lambda: self.model in httpx.get(f"{gateway.url}/v1/models", headers=dict(gateway.headers),
                                                   timeout=2).text, "the gateway to learn the key and route", 15, 0.2)

    def logs(self) -> dict[str, str]:
        return {name: process.log_path.read_text() for name, process in (("replica", self.replica),
                                                                         ("gateway", self.gateway))}

    def stop(self) -> None:
        self.gateway.stop()
        self.replica.stop()
        # Only what this suite published: other suites may share the Redis database.
        self.control.redis.hdel(ROUTING_KEY, self.model)
        self.control.redis.incr(ROUTING_GENERATION_KEY)
        self.control.redis.publish(ROUTING_CHANNEL, self.model)
        self.control.revoke(self.secret)
        self.control.redis.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, checkpoint_factory):
    raise_fd_limit(IDLE_CONNECTIONS + 1024)
    servers = Servers(tmp_path_factory.mktemp("openai-fuzz"), checkpoint_factory("tiny-llama", "llama"))
    started = time.monotonic()
    try:
        servers.wait_ready()
        yield servers
    finally:
        servers.stop()
        FIGURES["wall_s"] = round(time.monotonic() - started, 1)
        record("openai_fuzz", FIGURES)


def post(target: Target, path: str, body: bytes) -> httpx.Response:
    return httpx.post(target.url + path, content=body, timeout=60,
                      headers={"content-type": "application/json", **dict(target.headers)})


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    assert openai_error(response.content) is None, response.text[:300]
    return response.json()["error"]


def serves(target: Target) -> bool:
    response = post(target, CHAT, dumps(chat_body(target)))
    return response.status_code == 200 and response.json()["choices"]


SERVERS = pytest.mark.parametrize("name", ["replica", "gateway"])


# -- the fuzzer ---------------------------------------------------------------------------------


@SERVERS
def test_fuzz_cases_get_a_4xx_or_are_cut_off_and_the_server_keeps_serving(servers, name):
    target = servers.targets[name]
    cases = generate(SEED, COUNTS, target)
    started = time.monotonic()
    report = asyncio.run(run(target, cases, every=EVERY, raw_concurrency=scaled(20, 100),
                             progress=lambda line: print(line, flush=True)))
    FIGURES["servers"].setdefault(name, {}).update(report.figures(), fuzz_wall_s=round(time.monotonic() - started, 1))
    print(f"openai fuzz {name}: {json.dumps(report.figures())}")
    assert report.defects == [], "\n".join(report.defects[:40])
    assert report.well_formed_failed == [], report.well_formed_failed[:10]
    assert report.well_formed_served >= len([c for c in cases if c.raw is None]) // EVERY
    assert report.longest_cut_s <= CUT_BOUND_S


@SERVERS
def test_thousands_of_idle_connections_are_closed_and_requests_still_served(servers, name):
    target = servers.targets[name]
    flood = asyncio.run(idle_flood(target, IDLE_CONNECTIONS, hold_well_formed=5))
    FIGURES["servers"].setdefault(name, {})["idle_flood"] = flood
    print(f"idle flood {name}: {flood}")
    assert flood["failed_to_open"] == 0 and flood["opened"] == IDLE_CONNECTIONS, flood
    assert flood["still_open_after_bound"] == 0, flood
    assert flood["well_formed_failed"] == [] and flood["well_formed_served"] == 6, flood


# -- regression tests: one per defect the fuzzer found ------------------------------------------


@SERVERS
def test_deeply_nested_json_is_a_400_not_a_500(servers, name):
    """json.loads raised RecursionError (not a ValueError) past ~1,000 levels: a 500 from both servers."""
    target = servers.targets[name]
    just_below_json_limit = dumps(chat_body(target, messages="__literal__"), b"[" * 990 + b"]" * 990)
    for body in (b"[" * 100_000 + b"]" * 100_000, just_below_json_limit, b'{"a":' * 5000 + b"1" + b"}" * 5000):
        error = assert_openai_error(post(target, CHAT, body), 400)
        assert "nested deeper than 64 levels" in error["message"] and error["param"] == "body"


@SERVERS
def test_nan_temperature_is_a_400_and_the_engine_keeps_serving(servers, name):
    """A NaN temperature reached the sampler and stopped the engine loop: every later request was a 500."""
    target = servers.targets[name]
    for literal in ("NaN", "Infinity", "-Infinity"):
        error = assert_openai_error(post(target, COMPLETIONS, dumps(completion_body(target, temperature="__literal__"),
                                                                    literal)), 400)
        assert f"{literal} is not valid JSON" in error["message"]
    assert serves(target)


def test_sampling_params_refuse_a_nan_temperature():
    from runtime.engine.sampling import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


@SERVERS
def test_a_number_beyond_a_float_is_a_400_not_a_500(servers, name):
    """float(10**400) raised OverflowError (a 500); 1e400 read as infinity and was accepted."""
    target = servers.targets[name]
    for literal, param in (("1" + "0" * 400, "temperature"), ("1e400", "body"), ("-1e400", "body")):
        body = dumps(completion_body(target, temperature="__literal__"), literal)
        assert assert_openai_error(post(target, COMPLETIONS, body), 400)["param"] == param
    assert serves(target)


@SERVERS
def test_a_5000_digit_integer_is_a_400_not_a_500(servers, name):
    """Beyond Python's int_max_str_digits json.loads raises a plain ValueError the replica did not catch."""
    target = servers.targets[name]
    error = assert_openai_error(post(target, COMPLETIONS, dumps(completion_body(target, max_tokens="__literal__"),
                                                                "9" * 5000)), 400)
    assert error["param"] == "body"


@SERVERS
def test_an_unpaired_surrogate_is_a_400_not_a_500(servers, name):
    """"\\ud800" is valid JSON syntax; the tokenizer raised TypeError on it (a 500)."""
    target = servers.targets[name]
    for body in (dumps(completion_body(target, prompt="__literal__"), b'"x \\ud800"'),
                 dumps(chat_body(target, messages=[{"role": "user", "content": "__literal__"}]), b'"\\udfff"')):
        error = assert_openai_error(post(target, COMPLETIONS if b'"prompt"' in body else CHAT, body), 400)
        assert "surrogate" in error["message"]
    assert post(target, CHAT, dumps(chat_body(target, messages=[{"role": "user", "content": "\U0001f600"}]))
                ).status_code == 200  # a surrogate pair is a character


@SERVERS
def test_a_5000_digit_logit_bias_key_is_a_400_not_a_500(servers, name):
    target = servers.targets[name]
    error = assert_openai_error(post(target, COMPLETIONS, dumps(completion_body(target, logit_bias={"1" * 5000: 1}))),
                                400)
    assert error["param"] == "logit_bias" and len(error["message"]) < 200


@SERVERS
def test_a_message_role_that_is_an_object_or_array_is_a_400_not_a_500(servers, name):
    """`role not in CHAT_ROLES` raised TypeError (unhashable) for a dict or list role."""
    target = servers.targets[name]
    for role in ({}, {"a": 1}, ["user"]):
        body = dumps(chat_body(target, messages=[{"role": role, "content": "hi"}]))
        assert assert_openai_error(post(target, CHAT, body), 400)["param"] == "messages[0].role"


@SERVERS
def test_a_message_name_that_is_not_a_string_is_a_400(servers, name):
    target = servers.targets[name]
    body = dumps(chat_body(target, messages=[{"role": "user", "content": "hi", "name": 5}]))
    assert assert_openai_error(post(target, CHAT, body), 400)["param"] == "messages[0].name"


@SERVERS
def test_stream_options_of_the_wrong_shape_are_a_400(servers, name):
    """The replica took any include_usage; the gateway rewrote a stream_options of the wrong
    shape into a valid one, so the request was served."""
    target = servers.targets[name]
    for options in ("yes", [True], {"include_usage": "yes"}, {"include_usage": 0}):
        body = dumps(chat_body(target, stream=True, stream_options=options))
        assert assert_openai_error(post(target, CHAT, body), 400)["param"] == "stream_options"
    stream = post(target, CHAT, dumps(chat_body(target, stream=True, stream_options={"include_usage": False})))
    assert stream.status_code == 200 and b'"usage"' not in stream.content  # the gateway still strips what it added


@SERVERS
def test_a_content_length_over_the_limit_is_a_413_at_once(servers, name):
    """The gateway waited for a body it would refuse anyway (and, never sent, forever)."""
    target = servers.targets[name]
    raw = http_request(target, CHAT, b"", content_length=target.max_body_bytes + 1)
    outcome = asyncio.run(send_raw(target, Case("regression", "announced", raw=raw, send="hold"), CUT_BOUND_S))
    assert outcome.status == 413 and outcome.defect is None and outcome.seconds < READ_TIMEOUT_S, outcome


@SERVERS
def test_slow_loris_headers_are_cut_off_with_a_408(servers, name):
    """uvicorn has no header-read timeout: a byte a second held the connection forever."""
    target = servers.targets[name]
    raw = http_request(target, CHAT, dumps(chat_body(target)))
    outcome = asyncio.run(send_raw(target, Case("regression", "trickle", raw=raw, send="trickle-from-0"), CUT_BOUND_S))
    assert outcome.cut and outcome.status == 408 and outcome.defect is None, outcome
    assert outcome.seconds <= CUT_BOUND_S


@SERVERS
def test_a_body_that_never_comes_is_cut_off_with_a_408(servers, name):
    """A Content-Length larger than what is sent, or a body trickled: the app waited forever."""
    target = servers.targets[name]
    body = dumps(chat_body(target))
    short = http_request(target, CHAT, body[:10], content_length=len(body))
    trickled = http_request(target, CHAT, body)
    cases = (Case("regression", "short", raw=short, send="hold"),
             Case("regression", "trickle", raw=trickled, send=f"trickle-from-{trickled.index(body)}"))

    async def both() -> list:
        return await asyncio.gather(*(send_raw(target, case, CUT_BOUND_S) for case in cases))

    for outcome in asyncio.run(both()):
        assert outcome.cut and outcome.status == 408 and outcome.defect is None, outcome
    assert serves(target)


@SERVERS
def test_an_idle_connection_is_closed_by_the_read_timeout(servers, name):
    target = servers.targets[name]
    outcome = asyncio.run(send_raw(target, Case("regression", "idle", raw=b"", send="hold"), CUT_BOUND_S))
    assert outcome.cut and outcome.status is None and outcome.defect is None, outcome
    assert READ_TIMEOUT_S * 0.9 <= outcome.seconds <= CUT_BOUND_S


@SERVERS
def test_invalid_http_is_an_openai_error_not_text(servers, name):
    """uvicorn answered unparsable HTTP with a text/plain 400."""
    target = servers.targets[name]
    raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
    outcome = asyncio.run(send_raw(target, Case("regression", "bad-http", raw=raw), CUT_BOUND_S))
    assert outcome.status == 400 and outcome.defect is None, outcome


def test_the_servers_logged_no_unhandled_error(servers):
    """Last, after every case above: a client gone mid-body was logged by the replica as an
    unhandled error with a traceback; nothing the fuzzer sends may leave one."""
    for name, log in servers.logs().items():
        for sign in ("Traceback", "unhandled error", "Exception in ASGI application"):
            assert sign not in log, f"{name} log:\n{log[-3000:]}"
