"""A fuzzer of our own over the OpenAI request shapes (/v1/chat/completions, /v1/completions,
/v1/embeddings), for the gateway and the replica server (issue 40).

Each family is a generator of concrete requests, seeded, so a run sends the same bytes every
time. JSON-level cases go through httpx; byte-level ones (bad HTTP, bodies announced and never
sent, trickled headers and bodies) are written on raw sockets. `check` says what the answer
must be: a 4xx with an OpenAI-style error body, a 2xx only where the case is a valid request,
or, for a request that never arrives whole, the server cutting it off within its read timeout;
never a 5xx, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
LITERAL = "__literal__"  # a placeholder in a body, replaced by raw JSON text (NaN, 1e400, ...)


@dataclass(frozen=True)
class Target:
    """A server under test: where it listens, its headers (the gateway's API key) and its limits."""

    name: str
    host: str
    port: int
    model: str
    max_body_bytes: int
    read_timeout_s: float
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    path: str = CHAT
    body: bytes = b""
    must_refuse: bool = True  # a 2xx answer is a defect too
    raw: bytes | None = None  # byte-level: the request as written on the socket
    send: str = "whole"  # raw: "whole", "hold" (then nothing more), "trickle" (a byte per trickle_s)
    trickle_s: float = 1.0


@dataclass
class Outcome:
    case: Case
    status: int | None  # None: the connection closed without an answer
    seconds: float
    defect: str | None = None
    cut: bool = False  # the server cut off a request that never arrived whole


# -- bodies ---------------------------------------------------------------------------------------


def dumps(value: Any, literal: str | bytes | None = None) -> bytes:
    text = json.dumps(value, separators=(",", ":")).encode()
    if literal is not None:
        text = text.replace(json.dumps(LITERAL).encode(), literal.encode() if isinstance(literal, str) else literal)
    return text


def chat_body(t: Target, **fields: Any) -> dict:
    return {"model": t.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **fields}


def completion_body(t: Target, **fields: Any) -> dict:
    return {"model": t.model, "prompt": "Once upon a time", "max_tokens": 4, **fields}


def embedding_body(t: Target, **fields: Any) -> dict:
    return {"model": t.model, "input": "hello", **fields}


BODIES: dict[str, Callable[..., dict]] = {CHAT: chat_body, COMPLETIONS: completion_body, EMBEDDINGS: embedding_body}


def well_formed(t: Target, index: int) -> tuple[str, bytes]:
    """The well-formed requests interleaved with the cases: plain chat, streamed chat, completion."""
    kind = index % 3
    if kind == 0:
        return CHAT, dumps(chat_body(t))
    if kind == 1:
        return CHAT, dumps(chat_body(t, stream=True, stream_options={"include_usage": True}))
    return COMPLETIONS, dumps(completion_body(t))


def http_request(t: Target, path: str, body: bytes, *, content_length: int | None = None,
                 extra: tuple[bytes, ...] = ()) -> bytes:
    head = [f"POST {path} HTTP/1.1", f"Host: {t.host}:{t.port}", "Content-Type: application/json",
            f"Content-Length: {len(body) if content_length is None else content_length}",
            *(f"{name}: {value}" for name, value in t.headers)]
    return "\r\n".join(head).encode() + b"\r\n" + b"".join(line + b"\r\n" for line in extra) + b"\r\n" + body


# -- families: each yields `count` cases for a target, the same ones for the same seed --------------


def malformed_json(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    fixed = [b"", b"{", b"}", b"null", b"[]", b"1", b'"text"', b"true", b"{'model': 'x'}", b'{"model":"x",}',
             b'{"model" "x"}', b"\x00", b'{"a":1}{"b":2}', b"[{}]"]
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        valid = dumps(BODIES[path](t))
        how = rng.choice(["fixed", "truncate", "delete", "insert", "garbage"])
        if how == "fixed":
            body = fixed[i % len(fixed)]
        elif how == "truncate":
            body = valid[:rng.randrange(1, len(valid))]
        elif how == "delete":
            spots = [j for j, byte in enumerate(valid) if byte in b'{}[]":,']
            j = rng.choice(spots)
            body = valid[:j] + valid[j + 1:]
        elif how == "insert":
            j = rng.randrange(len(valid))
            body = valid[:j] + bytes([rng.choice(b'{}[]":,')]) + valid[j:]
        else:
            body = valid + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        yield Case("malformed_json", f"{how}-{i}", path, body, must_refuse=not _json_object(body))


def _json_object(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


# The JSON kinds each field takes; any other kind is a wrong type.
FIELD_KINDS: dict[str, dict[str, set[str]]] = {
    CHAT: {"model": {"str"}, "messages": {"list"}, "max_tokens": {"int"}, "max_completion_tokens": {"int"},
           "temperature": {"int", "float"}, "top_p": {"int", "float"}, "top_k": {"int"}, "min_p": {"int", "float"},
           "n": {"int"}, "seed": {"int"}, "stop": {"str", "list"}, "stop_token_ids": {"list"}, "ignore_eos": {"bool"},
           "stream": {"bool"}, "stream_options": {"obj"}, "priority": {"int"}, "presence_penalty": {"int", "float"},
           "frequency_penalty": {"int", "float"}, "repetition_penalty": {"int", "float"}, "logprobs": {"bool"},
           "top_logprobs": {"int"}, "logit_bias": {"obj"}, "min_tokens": {"int"}},
    EMBEDDINGS: {"model": {"str"}, "input": {"str", "list"}, "encoding_format": {"str"}},
}
FIELD_KINDS[COMPLETIONS] = {**{k: v for k, v in FIELD_KINDS[CHAT].items()
                               if k not in ("messages", "max_completion_tokens", "top_logprobs")},
                            "prompt": {"str", "list"}, "echo": {"bool"}, "logprobs": {"int"}}
WRONG_VALUES: dict[str, list[Any]] = {
    "str": ["x", "", "\u00e9t\u00e9", "4"], "int": [3, -7, 2**40], "float": [0.5, 1e10, 2.0],
    "bool": [True, False], "list": [[], [1], ["a"], [{"a": 1}]], "obj": [{}, {"a": 1}, {"role": "user"}],
}
MESSAGE_KINDS = {"role": {"str"}, "content": {"str", "list"}, "name": {"str"}}


def wrong_types(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        path = rng.choice([CHAT, CHAT, COMPLETIONS, EMBEDDINGS])
        body = BODIES[path](t)
        if path == CHAT and rng.random() < 0.25:
            name = rng.choice(sorted(MESSAGE_KINDS))
            kind = rng.choice(sorted(set(WRONG_VALUES) - MESSAGE_KINDS[name]))
            body["messages"][0][name] = rng.choice(WRONG_VALUES[kind])
            yield Case("wrong_types", f"messages[0].{name}={kind}-{i}", path, dumps(body))
            continue
        name = rng.choice(sorted(FIELD_KINDS[path]))
        kind = rng.choice(sorted(set(WRONG_VALUES) - FIELD_KINDS[path][name]))
        body[name] = rng.choice(WRONG_VALUES[kind])
        if name == "stream_options":
            body["stream"] = True
        yield Case("wrong_types", f"{name}={kind}-{i}", path, dumps(body))


def huge_bodies(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    """Bodies over the server's limit, whole or announced by a Content-Length that is never sent."""
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        over = t.max_body_bytes + rng.choice([1, 1000, 2**20])
        if i % 3 == 2:  # only announced: the answer must not wait for it
            body = dumps(BODIES[path](t))
            raw = http_request(t, path, body, content_length=over)
            yield Case("huge_bodies", f"announced-{over}-{i}", path, raw=raw, send="hold")
            continue
        filler = "x" * over
        body = dumps(chat_body(t, messages=[{"role": "user", "content": filler}]) if path == CHAT
                     else BODIES[path](t, **{"prompt" if path == COMPLETIONS else "input": filler}))
        yield Case("huge_bodies", f"whole-{len(body)}-{i}", path, body)


def deep_nesting(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        depth = rng.choice([65, 200, 900, 990, 999, 1000, 1500, 5000, 100_000])
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        where = rng.choice(["top", "objects", "field", "message"])
        arrays = b"[" * depth + b"]" * depth
        if where == "top":
            body = arrays
        elif where == "objects":
            body = b'{"a":' * depth + b"1" + b"}" * depth
        elif where == "field":
            name = rng.choice(["messages", "prompt", "input", "logit_bias", "stream_options", "stop"])
            body = dumps(BODIES[path](t, **{name: LITERAL}), arrays)
        else:
            path = CHAT
            body = dumps(chat_body(t, messages=[{"role": "user", "content": LITERAL}]), arrays)
        yield Case("deep_nesting", f"{where}-{depth}-{i}", path, body)


BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80",
            b"\xf8\x88\x80\x80\x80"]
LONE_SURROGATES = [b"\\ud800", b"\\udfff", b"\\udbff x", b"x \\udc00", b"\\ud83d"]


def invalid_utf8(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        text = "Say hi." if path == CHAT else "Once upon a time" if path == COMPLETIONS else "hello"
        valid = dumps(BODIES[path](t))
        bad = rng.choice(BAD_UTF8 + LONE_SURROGATES)
        if rng.random() < 0.2:  # in a key rather than a value
            body = valid.replace(b'"model"', b'"mo' + bad + b'del"', 1)
        else:
            j = rng.randrange(len(text) + 1)
            body = valid.replace(text.encode(), text[:j].encode() + bad + text[j:].encode(), 1)
        yield Case("invalid_utf8", f"{bad!r}-{i}", path, body)


# (integer, low, high, low_open): the values a field takes; anything else must be refused.
NUMERIC_RANGES: dict[str, tuple[bool, float, float, bool]] = {
    "max_tokens": (True, 1, 200, False), "n": (True, 1, 16, False), "logprobs": (True, 0, 20, False),
    "top_logprobs": (True, 0, 20, False), "temperature": (False, 0, math.inf, False),
    "top_p": (False, 0, 1, True), "min_p": (False, 0, 1, False), "min_tokens": (True, 0, 4, False),
    "top_k": (True, -1, math.inf, False), "seed": (True, -2**63, 2**63 - 17, False),
    "presence_penalty": (False, -2, 2, False),
}
NUMERIC_LITERALS = ["-1", "0", "-0.0", "2.5", "1e-400", str(-2**63), str(2**63), str(10**30), "1e400", "-1e400",
                    "NaN", "Infinity", "-Infinity", "9" * 5000, "1e308", "4", "16", "17", "20", "21"]


def _in_range(name: str, literal: str) -> bool:
    integer, low, high, low_open = NUMERIC_RANGES[name]
    if literal in ("NaN", "Infinity", "-Infinity") or len(literal) > 4300:
        return False
    value = json.loads(literal)
    if integer and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    return (low < value if low_open else low <= value) and value <= high


def numeric_extremes(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        name = rng.choice(sorted(NUMERIC_RANGES))
        literal = rng.choice(NUMERIC_LITERALS)
        if name == "top_logprobs":
            path, body = CHAT, chat_body(t, logprobs=True, top_logprobs=LITERAL)
        elif name == "logprobs":
            path, body = COMPLETIONS, completion_body(t, logprobs=LITERAL)
        else:
            path = rng.choice([CHAT, COMPLETIONS])
            body = BODIES[path](t, **{name: LITERAL})
        yield Case("numeric_extremes", f"{name}={literal[:12]}-{i}", path, dumps(body, literal),
                   must_refuse=not _in_range(name, literal))


WORDS = ["the", "model", "token", "cache", "stream", "alpha", "\u00e9t\u00e9", "\u4e2d\u6587", "42", "!"]


def prompts(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    """Empty prompts (valid) and 1 MB ones (past the tiny model's context: refused)."""
    megabyte = " ".join(rng.choice(WORDS) for _ in range(200_000)).encode()[:2**20].decode("utf-8", "ignore")
    shapes: list[tuple[str, str, dict, bool]] = [
        ("empty-prompt", COMPLETIONS, completion_body(t, prompt=""), False),
        ("empty-content", CHAT, chat_body(t, messages=[{"role": "user", "content": ""}]), False),
        ("blank-prompt", COMPLETIONS, completion_body(t, prompt="   \n\t "), False),
        ("empty-token-list", COMPLETIONS, completion_body(t, prompt=[]), True),
        ("empty-input", EMBEDDINGS, embedding_body(t, input=""), True),
        ("1mb-prompt", COMPLETIONS, completion_body(t, prompt=megabyte), True),
        ("1mb-content", CHAT, chat_body(t, messages=[{"role": "user", "content": megabyte}]), True),
        ("1mb-token-ids", COMPLETIONS, completion_body(t, prompt=[7] * 200_000), True),
        ("1mb-input", EMBEDDINGS, embedding_body(t, input=megabyte), True),
        ("1mb-stop", CHAT, chat_body(t, stop=megabyte), False),
    ]
    order = rng.sample(range(len(shapes)), len(shapes))  # each shape once before any twice
    for i in range(count):
        name, path, body, must_refuse = shapes[order[i] if i < len(order) else rng.randrange(len(shapes))]
        yield Case("prompts", f"{name}-{i}", path, dumps(body), must_refuse=must_refuse)


UNSUPPORTED = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
               "response_format": {"type": "json_object"}, "best_of": 2, "suffix": "x", "tool_choice": "auto",
               "functions": [{"name": "f"}], "function_call": "auto", "echo": True}


def unknown_fields(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        body = BODIES[path](t)
        how = rng.choice(["random", "odd", "unsupported", "message"])
        if how == "random":
            name = f"fuzz_{rng.getrandbits(32):08x}"
        elif how == "odd":
            name = rng.choice(["", " ", "MAX_TOKENS", "max_tokens ", "__proto__", "\u00e9t\u00e9", "a" * 10_000,
                               "model\u0000"])
        elif how == "unsupported" and path == CHAT:
            name = rng.choice(sorted(UNSUPPORTED))
        elif how == "message" and path == CHAT:
            body["messages"][0][rng.choice(["foo", "tool_call_id", "", "ROLE"])] = "x"
            yield Case("unknown_fields", f"message-field-{i}", path, dumps(body))
            continue
        else:
            name = rng.choice(["tools", "response_format", "best_of"]) if path != EMBEDDINGS else "dimensions"
        value = UNSUPPORTED.get(name, rng.choice([1, "x", True, [1], {"a": 1}]))
        body[name] = value if name != "dimensions" else 8
        yield Case("unknown_fields", f"{how}:{name[:20]!r}-{i}", path, dumps(body))


STREAM_OPTIONS: list[tuple[Any, Any]] = [
    (True, "yes"), (True, []), (True, 1), (True, True), (True, {"include_usage": "yes"}),
    (True, {"include_usage": 1}), (True, {"include_usage": 0}), (True, {"unknown": True}),
    (True, {"include_usage": True, "x": 1}), (False, {"include_usage": True}), (None, {"include_usage": True}),
    ("true", {"include_usage": True}), (True, {"include_usage": [True]}),
]


def bad_stream_options(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS])
        stream, options = STREAM_OPTIONS[i % len(STREAM_OPTIONS)] if i < len(STREAM_OPTIONS) \
            else rng.choice(STREAM_OPTIONS)
        extra = {"stream_options": options} | ({} if stream is None else {"stream": stream})
        yield Case("bad_stream_options", f"stream={stream!r},options={options!r}-{i}", path,
                   dumps(BODIES[path](t, **extra)))


BAD_MESSAGES: list[Any] = [
    [], {}, "hi", 1, [1], [None], [[]], ["hi"], [{"role": "user"}], [{"content": "x"}],
    [{"role": "tool", "content": "x"}],
    [{"role": "function", "content": "x"}], [{"role": 5, "content": "x"}], [{"role": "", "content": "x"}],
    [{"role": "USER", "content": "x"}], [{"role": "user", "content": 5}], [{"role": "user", "content": {}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [1]}], [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
    [{"role": "user", "content": "x", "name": 5}], [{"role": "user", "content": "x", "foo": 1}],
]


def bad_messages(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        bad = BAD_MESSAGES[i] if i < len(BAD_MESSAGES) else rng.choice(BAD_MESSAGES)
        if isinstance(bad, list) and bad and rng.random() < 0.5:  # hidden among good ones
            good = [{"role": "user", "content": f"m{j}"} for j in range(rng.choice([1, 10, 1000]))]
            bad = good[:rng.randrange(len(good) + 1)] + bad + good
        yield Case("bad_messages", f"{json.dumps(bad)[:60]}-{i}", CHAT, dumps(chat_body(t, messages=bad)))


BAD_HTTP = [
    b"GARBAGE\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"POST /v1/ completions HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHo\x7fst: x\r\n\r\n", b"\r\n\r\n\r\n\r\n", b"\x00" * 64,
]


def bad_http(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    for i in range(count):
        if i % 4 == 3:  # a valid request with a 1 MB header or URL: accepted or refused, never a 5xx
            body = dumps(chat_body(t))
            if rng.random() < 0.5:
                raw = http_request(t, CHAT, body, extra=(b"X-Fuzz: " + b"a" * 2**20,))
            else:
                raw = http_request(t, CHAT + "?q=" + "a" * 2**20, body)
            yield Case("bad_http", f"1mb-header-or-url-{i}", CHAT, raw=raw, must_refuse=False)
            continue
        yield Case("bad_http", f"{i % len(BAD_HTTP)}-{i}", raw=BAD_HTTP[i % len(BAD_HTTP)] if i < len(BAD_HTTP)
                   else rng.choice(BAD_HTTP))


def missing_body(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    """Headers that announce a body (Content-Length larger than what is sent, or a chunk never
    finished), then silence: the server must cut it off by its read timeout."""
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS, EMBEDDINGS])
        body = dumps(BODIES[path](t))
        sent = body[:rng.randrange(len(body))]
        if i % 3 == 2:
            head = http_request(t, path, b"", extra=(b"Transfer-Encoding: chunked",))
            head = head.replace(b"Content-Length: 0\r\n", b"")
            raw = head + f"{len(body):x}\r\n".encode() + sent
        else:
            raw = http_request(t, path, sent, content_length=len(body) + rng.choice([1, 100, 10_000]))
        yield Case("missing_body", f"{len(sent)}-of-{len(body)}-{i}", path, raw=raw, send="hold")


def trickled(rng: random.Random, count: int, t: Target) -> Iterator[Case]:
    """Slow-loris: a whole valid request, one byte a second (headers, or the body after whole headers)."""
    for i in range(count):
        path = rng.choice([CHAT, COMPLETIONS])
        raw = http_request(t, path, dumps(BODIES[path](t)))
        if i % 2:
            split = raw.index(b"\r\n\r\n") + 4
            yield Case("trickled_body", f"body-{i}", path, raw=raw, send=f"trickle-from-{split}")
        else:
            yield Case("trickled_headers", f"headers-{i}", path, raw=raw, send="trickle-from-0")


FAMILIES: dict[str, Callable[[random.Random, int, Target], Iterator[Case]]] = {
    "malformed_json": malformed_json, "wrong_types": wrong_types, "huge_bodies": huge_bodies,
    "deep_nesting": deep_nesting, "invalid_utf8": invalid_utf8, "numeric_extremes": numeric_extremes,
    "prompts": prompts, "unknown_fields": unknown_fields, "bad_stream_options": bad_stream_options,
    "bad_messages": bad_messages, "bad_http": bad_http, "missing_body": missing_body, "trickled": trickled,
}


def generate(seed: int, counts: dict[str, int], t: Target) -> list[Case]:
    """Every family's cases, in a seeded order (the families interleaved, as they would arrive)."""
    cases = []
    for name, family in FAMILIES.items():
        rng = random.Random(f"{seed}-{name}")
        cases += list(family(rng, counts[name], t))
    random.Random(seed).shuffle(cases)
    return cases


# -- sending and judging --------------------------------------------------------------------------


def openai_error(body: bytes) -> str | None:
    """None if `body` is an OpenAI-style error, else what is wrong with it."""
    try:
        document = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:80]!r}"
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) \
            or not isinstance(error.get("type"), str):
        return f"not an OpenAI error: {body[:80]!r}"
    return None


def judge(case: Case, status: int | None, body: bytes, content_type: str) -> str | None:
    """The defect in this answer, if any."""
    if status is None:
        return None
    if status >= 500:
        return f"{status}: {body[:120]!r}"
    if 400 <= status < 500:
        return openai_error(body)
    if 200 <= status < 300:
        if case.must_refuse:
            return f"accepted ({status}) what must be refused"
        if content_type.startswith("text/event-stream"):
            return None if b"data: [DONE]" in body else f"stream without [DONE]: {body[-120:]!r}"
        try:
            json.loads(body)
        except ValueError:
            return f"2xx but not JSON: {body[:80]!r}"
        return None
    return f"unexpected status {status}"


async def send_json(client: httpx.AsyncClient, t: Target, case: Case, timeout_s: float) -> Outcome:
    started = time.monotonic()
    try:
        response = await client.post(t.url + case.path, content=case.body, timeout=timeout_s,
                                     headers={"content-type": "application/json", **dict(t.headers)})
    except httpx.TimeoutException:
        return Outcome(case, None, time.monotonic() - started, f"no answer within {timeout_s} s (a hang)")
    except httpx.TransportError as exc:
        return Outcome(case, None, time.monotonic() - started, f"connection failed: {exc!r}")
    seconds = time.monotonic() - started
    return Outcome(case, response.status_code, seconds,
                   judge(case, response.status_code, response.content, response.headers.get("content-type", "")))


async def read_response(reader: asyncio.StreamReader) -> tuple[int | None, bytes, str]:
    """One HTTP/1.1 response (status, body, content type); status None if the connection closed first."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(65536)
        if not chunk:
            return None, head, ""
        head += chunk
    head, _, rest = head.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    length = headers.get(b"content-length")
    if length is not None:
        while len(rest) < int(length):
            chunk = await reader.read(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest[:int(length)], headers.get(b"content-type", b"").decode()
    while chunk := await reader.read(65536):  # chunked or until close: enough to judge
        rest += chunk
        if rest.endswith(b"0\r\n\r\n"):
            break
    return status, rest, headers.get(b"content-type", b"").decode()


async def send_raw(t: Target, case: Case, bound_s: float) -> Outcome:
    """Writes the case's bytes as it says, then waits (at most `bound_s` after the last byte it
    meant to send at once) for an answer or for the server to close the connection."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(t.host, t.port)
    except OSError as exc:
        return Outcome(case, None, time.monotonic() - started, f"cannot connect: {exc!r}")
    answer: asyncio.Task = asyncio.ensure_future(read_response(reader))
    try:
        if case.send.startswith("trickle-from-"):
            split = int(case.send.removeprefix("trickle-from-"))
            writer.write(case.raw[:split])
            for byte in case.raw[split:]:
                if answer.done():
                    break
                await asyncio.sleep(case.trickle_s)
                writer.write(bytes([byte]))
        else:
            writer.write(case.raw)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the server closed it while we were still writing; its answer, if any, is read below
        try:
            status, body, content_type = await asyncio.wait_for(answer, bound_s)
        except TimeoutError:
            return Outcome(case, None, time.monotonic() - started,
                           f"connection still open {bound_s:g} s after the request stopped (a hang)")
        except ConnectionError:
            status, body, content_type = None, b"", ""
    except ConnectionError:  # reset while trickling: the server cut it off
        status, body, content_type = None, b"", ""
        answer.cancel()
    finally:
        writer.close()
    seconds = time.monotonic() - started
    slow = case.send != "whole"
    if slow and status in (None, 408):
        late = seconds > bound_s  # counted from the first byte, as the server counts
        defect = f"cut off only after {seconds:.1f} s" if late else openai_error(body) if status == 408 else None
        return Outcome(case, status, seconds, defect, cut=True)
    if slow and status is not None and 200 <= status < 300:
        return Outcome(case, status, seconds, f"never cut off: answered {status} after {seconds:.0f} s")
    if status is None and case.must_refuse:  # closed without an answer: refused, or cut off by the read timeout
        return Outcome(case, None, seconds, None, cut=seconds >= t.read_timeout_s)
    return Outcome(case, status, seconds, judge(case, status, body, content_type))


@dataclass
class Report:
    """What one server did with the cases, for the assertions and bench/reliability/results."""

    cases: Counter = field(default_factory=Counter)  # per family
    statuses: Counter = field(default_factory=Counter)  # "400", "413", "200", "closed", ...
    cut_by_timeout: int = 0
    well_formed_served: int = 0
    well_formed_failed: list[str] = field(default_factory=list)
    longest_answer_s: float = 0.0
    longest_cut_s: float = 0.0
    defects: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.cases[outcome.case.family] += 1
        self.statuses["closed" if outcome.status is None else str(outcome.status)] += 1
        if outcome.cut:
            self.cut_by_timeout += 1
            self.longest_cut_s = max(self.longest_cut_s, outcome.seconds)
        else:
            self.longest_answer_s = max(self.longest_answer_s, outcome.seconds)
        if outcome.defect:
            self.defects.append(f"{outcome.case.family}/{outcome.case.name} {outcome.case.path}: {outcome.defect}")

    def figures(self) -> dict[str, Any]:
        return {"cases_per_family": dict(sorted(self.cases.items())), "cases": sum(self.cases.values()),
                "answers_by_status": dict(sorted(self.statuses.items())), "cut_off_by_timeout": self.cut_by_timeout,
                "well_formed_served": self.well_formed_served, "well_formed_failed": len(self.well_formed_failed),
                "longest_answer_s": round(self.longest_answer_s, 3), "longest_cut_off_s": round(self.longest_cut_s, 3),
                "defects": self.defects[:50]}


async def check_well_formed(client: httpx.AsyncClient, t: Target, index: int, report: Report) -> None:
    path, body = well_formed(t, index)
    try:
        response = await client.post(t.url + path, content=body, timeout=60,
                                     headers={"content-type": "application/json", **dict(t.headers)})
        ok = response.status_code == 200 and (b"data: [DONE]" in response.content if b'"stream":true' in body
                                              else "choices" in response.json())
        failure = None if ok else f"{response.status_code}: {response.text[:200]}"
    except (httpx.HTTPError, ValueError) as exc:
        failure = repr(exc)
    if failure is None:
        report.well_formed_served += 1
    else:
        report.well_formed_failed.append(f"{path} after case {index}: {failure}")


async def run(t: Target, cases: list[Case], *, every: int, raw_concurrency: int, json_timeout_s: float = 60,
              progress: Callable[[str], None] | None = None) -> Report:
    """Sends every case: JSON ones one at a time with a well-formed request after every `every`
    of them; byte-level ones alongside (slow ones take the read timeout each, so they overlap)."""
    report = Report()
    bound_s = t.read_timeout_s + 5  # the cut-off bound: the read timeout, plus slack for a loaded machine
    slots = asyncio.Semaphore(raw_concurrency)

    async def raw(case: Case) -> None:
        async with slots:
            report.add(await send_raw(t, case, bound_s))

    raw_tasks = [asyncio.ensure_future(raw(c)) for c in cases if c.raw is not None]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4)) as client:
        json_cases = [c for c in cases if c.raw is None]
        for i, case in enumerate(json_cases):
            report.add(await send_json(client, t, case, json_timeout_s))
            if (i + 1) % every == 0:
                await check_well_formed(client, t, i, report)
            if progress and (i + 1) % 500 == 0:
                progress(f"{t.name}: {i + 1}/{len(json_cases)} JSON cases")
        while not all(task.done() for task in raw_tasks):
            await check_well_formed(client, t, len(json_cases), report)  # served while slow clients hang on
            await asyncio.sleep(0.5)
        await asyncio.gather(*raw_tasks)
        await check_well_formed(client, t, len(json_cases) + 1, report)
    return report


async def idle_flood(t: Target, connections: int, hold_well_formed: int) -> dict[str, Any]:
    """Opens `connections` connections that send nothing, serves well-formed requests while they
    are open, and measures how long the server takes to close each."""
    opened: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []
    failed_to_open = 0
    for start in range(0, connections, 100):
        results = await asyncio.gather(*(asyncio.open_connection(t.host, t.port)
                                         for _ in range(start, min(start + 100, connections))),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                failed_to_open += 1
            else:
                opened.append((time.monotonic(), *result))
    report = Report()
    async with httpx.AsyncClient() as client:
        for i in range(hold_well_formed):
            await check_well_formed(client, t, i, report)
    bound_s = t.read_timeout_s + 10

    async def closed_after(started: float, reader: asyncio.StreamReader) -> float | None:
        try:
            await asyncio.wait_for(reader.read(1), max(0.1, started + bound_s - time.monotonic()))
        except TimeoutError:
            return None
        except ConnectionError:
            pass
        return time.monotonic() - started

    times = await asyncio.gather(*(closed_after(started, reader) for started, reader, _ in opened))
    for _, _, writer in opened:
        writer.close()
    async with httpx.AsyncClient() as client:
        await check_well_formed(client, t, hold_well_formed, report)
    closed = [s for s in times if s is not None]
    return {"connections": connections, "opened": len(opened), "failed_to_open": failed_to_open,
            "closed_by_server": len(closed), "still_open_after_bound": len(times) - len(closed),
            "bound_s": bound_s, "longest_open_s": round(max(closed, default=0.0), 3),
            "well_formed_served": report.well_formed_served, "well_formed_failed": report.well_formed_failed}
