"""`inferops bench`: a load generator for any OpenAI-compatible endpoint.

It sends synthetic streaming requests at a Poisson (or gamma, `--burstiness`) arrival rate, with an
optional concurrency cap, and reports latency the way `vllm bench serve` defines it, so numbers
from the built-in engine, vLLM and the gateway compare directly:

- TTFT: from sending the request to the first streamed chunk that carries output text.
- ITL: the gaps between successive chunks that carry output text.
- E2EL: from sending the request to the end of its stream.
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
- goodput: requests per second that met every given SLO (ttft, tpot, e2el) at once; a one-token
  answer has no TPOT and counts as meeting a TPOT SLO.
- rejected: requests the built-in engine refused as unable to meet their latency targets (HTTP 503
  with error code `slo_late`, `--slo-reject-late`), counted apart from failures and never good.

Output tokens come from the stream's `usage` (requested with `stream_options.include_usage`),
falling back to the number of text chunks when a server sends no usage; input tokens likewise
come from `usage.prompt_tokens` (so chat-template tokens count), else the planned prompt length.

Prompts are random words from a fixed list, drawn with `--seed`. Without `--tokenizer` the input
length is counted in words (roughly one token each); with `--tokenizer DIR` (a folder holding
tokenizer.json) prompts are built to exact token counts. `--shared-prefix-len` adds a prefix
before the random part, as vLLM's `--random-prefix-len` does; `--shared-prefix-ratio` picks the
fraction of requests that share one prefix, the others get a private prefix of the same length
so that only cacheability differs.

With `--rates 1,2,4,8 --step-seconds 20` it measures a goodput curve instead: one step per rate, each
a run of its own at that Poisson rate for that long (rate × seconds requests, the server idle again
before the next step), reported per step as offered, throughput and goodput req/s, TTFT and TPOT
p95, completed and failed (`run_curve`). `inferops bench --save-curve DEPLOYMENT` also stores the
curve in the control plane, for the capacity planner (project/bench_cli.py).

`request_classes` (Python callers only) splits the requests into classes, each sent with its own
API key (e.g. keys of different priorities behind a gateway) in an exact share of the requests,
interleaved in one arrival process; the result then holds each class's own summary under
`classes`, and per request its class, send time, error kind and error code.

Python callers use `run_benchmark(BenchConfig(...)) -> dict`.

The client is aiohttp (C-accelerated HTTP parsing): the generator shares the machine with the
server it measures, and httpx's pure-Python HTTP/1.1 parser cost ~0.35 ms of CPU per streamed
chunk, a quarter of a 2-core machine at workload A's chunk rate. vLLM's `bench serve` uses
aiohttp for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from runtime.gateway.contract import SLO_LATE
from runtime.goodput import MAX_CURVE_STEPS, SLO_METRICS

PERCENTILES = (50, 90, 95, 99)
MAX_SSE_LINE_BYTES = 4 << 20  # aiohttp refuses longer lines; a chunk that long is not a token
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# Common, short English words: nearly all are one token in any English vocabulary, so a word
# count is a fair stand-in for a token count when no tokenizer is given.
WORDS = tuple(
    """
    the of and to in is was for on are as with his they at be this from have or by one had not
    but what all were when we there can an your which their said if do will each about how up
    out them then she many some so these would other into has more her two like him see time
    could no make than first been its who now people my made over did down only way find use
    may water long little very after words called just where most know get through back much
    before go good new write our used me man too any day same right look think also around
    another came come work three word must because does part even place well such here take why
    things help put years different away again off went old number great tell men say small
    every found still between name should home big give air line set own under read last never
    us left end along while might next sound below saw something thought both few those always
    looked show large often together asked house world going want school important until form
    food keep children feet land side without boy once animals life enough took sometimes four
    head above kind began almost live page got earth need far hand high year mother light parts
    country father let night following picture being study second eyes soon times story boys
    since white days ever paper hard near sentence better best across during today others sure
    means knew its try told young miles sun ways thing whole hear example heard several change
    answer room sea against top turned learn point city play toward five using himself usually
    """.split()
)


class BenchConfigError(ValueError):
    """A benchmark option is invalid; the message names the option."""


@dataclass(frozen=True)
class LengthRange:
    """A fixed length ("64") or an inclusive uniform range ("32-512")."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int, option: str = "length") -> LengthRange:
        try:
            if isinstance(text, int):
                low = high = text
            elif "-" in text:
                low_text, high_text = text.split("-", 1)
                low, high = int(low_text), int(high_text)
            else:
                low = high = int(text)
        except ValueError:
            raise BenchConfigError(f"{option}={text!r}: expected N or LOW-HIGH") from None
        if low < 1 or high < low:
            raise BenchConfigError(f"{option}={text!r}: need 1 <= LOW <= HIGH")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


@dataclass(frozen=True)
class RequestClass:
    """A share of the requests, sent with its own API key."""

    name: str
    api_key: str
    share: float


@dataclass
class BenchConfig:
    base_url: str
    model: str
    api_key: str = "none"
    endpoint: str = "completions"
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: LengthRange = field(default_factory=lambda: LengthRange(64, 64))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(64, 64))
    shared_prefix_len: int = 0
    shared_prefix_ratio: float = 1.0
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    # Empty: every request is sent with `api_key`.
    request_classes: list[RequestClass] = field(default_factory=list)
    seed: int = 0
    # Sampling sent with every request; greedy by default, as in vLLM's `bench serve`.
    temperature: float = 0.0
    top_p: float | None = None  # None: not sent (the server's default)
    top_k: int | None = None
    # Penalties, sent only when set (as vLLM's `bench serve` spells them).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # The built-in engine's scheduling priority, sent with every request when set (capacity runs send
    # the lowest, so a replica's live traffic goes first).
    priority: int | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    tokenizer_dir: str | None = None
    result_json: str | None = None
    show_progress: bool = True

    def validate(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise BenchConfigError(f"endpoint={self.endpoint!r}: expected chat or completions")
        if self.num_prompts < 1:
            raise BenchConfigError("num_prompts: must be at least 1")
        if not self.request_rate > 0:
            raise BenchConfigError("request_rate: must be > 0 (or inf)")
        if not self.burstiness > 0:
            raise BenchConfigError("burstiness: must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchConfigError("max_concurrency: must be at least 1")
        if self.shared_prefix_len < 0:
            raise BenchConfigError("shared_prefix_len: must be 0 or more")
        if not 0.0 <= self.shared_prefix_ratio <= 1.0:
            raise BenchConfigError("shared_prefix_ratio: must lie in [0, 1]")
        if not self.temperature >= 0:
            raise BenchConfigError("temperature: must be 0 (greedy) or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise BenchConfigError("top_p: must lie in (0, 1]")
        if self.top_k is not None and (self.top_k < 1 and self.top_k != -1):
            raise BenchConfigError("top_k: must be at least 1 (or -1 for off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                raise BenchConfigError(f"{name}: must lie in [-2, 2]")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise BenchConfigError("repetition_penalty: must be > 0")
        names = [request_class.name for request_class in self.request_classes]
        if len(set(names)) != len(names) or not all(names):
            raise BenchConfigError("request_classes: names must be non-empty and distinct")
        if not all(request_class.share > 0 for request_class in self.request_classes):
            raise BenchConfigError("request_classes: every share must be > 0")
        for name, limit in self.goodput_slos_ms.items():
            if name not in SLO_METRICS:
                raise BenchConfigError(f"goodput: unknown metric {name!r}; use ttft, tpot, e2el")
            if not limit > 0:
                raise BenchConfigError(f"goodput: {name} must be a positive number of ms")


@dataclass
class PlannedRequest:
    prompt: str
    prompt_len: int
    output_len: int
    request_class: str = ""


@dataclass
class RequestResult:
    success: bool = False
    error_kind: str = ""
    error_message: str = ""
    error_code: str = ""  # an error body's `code` (e.g. the gateway's "degraded")
    request_class: str = ""
    sent_at_s: float = 0.0  # from the start of the run
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


class WordTokenizer:
    """Counts words; used when no real tokenizer is given."""

    def text_of_length(self, length: int, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(length))


class ExactTokenizer:
    """Builds texts that a tokenizer.json encodes to exactly the asked number of tokens."""

    MAX_ADJUSTMENTS = 20

    def __init__(self, tokenizer_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            raise BenchConfigError(f"tokenizer={tokenizer_dir}: no tokenizer.json there")
        self.tokenizer = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text_of_length(self, length: int, rng: random.Random) -> str:
        # Decoding and re-encoding may merge or split tokens at the edges, so adjust until the
        # re-encoded text has exactly `length` tokens.
        ids = self.encode(" ".join(rng.choice(WORDS) for _ in range(length)))[:length]
        text = self.tokenizer.decode(ids)
        for _ in range(self.MAX_ADJUSTMENTS):
            ids = self.encode(text)
            if len(ids) == length:
                return text
            if len(ids) > length:
                ids = ids[:length]
            else:
                ids = ids + self.encode(" " + rng.choice(WORDS))[: length - len(ids)]
            text = self.tokenizer.decode(ids)
        raise RuntimeError(f"could not build a prompt of exactly {length} tokens")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class PromptPlanner:
    """Draws every request's prompt and lengths up front, so a seed fixes the whole workload."""

    def __init__(self, config: BenchConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.lengths = ExactTokenizer(config.tokenizer_dir) if config.tokenizer_dir else None

    def text_of_length(self, length: int) -> str:
        if self.lengths is None:
            return WordTokenizer().text_of_length(length, self.rng)
        return self.lengths.text_of_length(length, self.rng)

    def plan(self) -> list[PlannedRequest]:
        config = self.config
        prefix_len = config.shared_prefix_len
        num_sharing = round(config.num_prompts * config.shared_prefix_ratio) if prefix_len else 0
        sharing = set(self.rng.sample(range(config.num_prompts), num_sharing))
        shared_prefix = self.text_of_length(prefix_len) if prefix_len else ""
        planned = []
        for index in range(config.num_prompts):
            input_len = config.input_len.sample(self.rng)
            output_len = config.output_len.sample(self.rng)
            body = self.text_of_length(input_len)
            if prefix_len:
                prefix = shared_prefix if index in sharing else self.text_of_length(prefix_len)
                body = f"{prefix} {body}"
            planned.append(PlannedRequest(body, prefix_len + input_len, output_len))
        for request, name in zip(planned, self.class_names(), strict=True):
            request.request_class = name
        return planned

    def class_names(self) -> list[str]:
        """Each request's class: exact shares (largest remainders), shuffled by their own seed so
        that adding classes leaves the prompts of a seed unchanged."""
        classes, total = self.config.request_classes, self.config.num_prompts
        if not classes:
            return [""] * total
        weight = sum(request_class.share for request_class in classes)
        exact = [total * request_class.share / weight for request_class in classes]
        counts = [math.floor(value) for value in exact]
        by_remainder = sorted(range(len(classes)), key=lambda index: counts[index] - exact[index])
        for index in by_remainder[: total - sum(counts)]:
            counts[index] += 1
        names = [c.name for c, count in zip(classes, counts, strict=True) for _ in range(count)]
        random.Random(self.config.seed + 2).shuffle(names)
        return names


def arrival_gaps(
    num_requests: int, request_rate: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Seconds to wait before each request, as vllm bench serve draws them: gamma intervals
    with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    scale = 1.0 / (request_rate * burstiness)
    # The first request goes at once; the clock starts with it.
    return [0.0] + [rng.gammavariate(burstiness, scale) for _ in range(num_requests - 1)]


class StreamingClient:
    """Sends one streaming request and times its chunks."""

    def __init__(self, client: aiohttp.ClientSession, config: BenchConfig):
        self.client = client
        self.config = config
        self.url = config.base_url.rstrip("/") + ENDPOINT_PATHS[config.endpoint]
        self.keys = {c.name: c.api_key for c in config.request_classes}
        self.keys[""] = config.api_key

    def headers(self, request: PlannedRequest) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[request.request_class]}"}

    def payload(self, request: PlannedRequest) -> dict:
        body: dict = {
            "model": self.config.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.config.temperature,
        }
        if self.config.top_p is not None:
            body["top_p"] = self.config.top_p
        if self.config.top_k is not None:
            body["top_k"] = self.config.top_k
        for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
            if getattr(self.config, name) is not None:
                body[name] = getattr(self.config, name)
        if self.config.priority is not None:
            body["priority"] = self.config.priority
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        return body

    async def send(self, request: PlannedRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len, request_class=request.request_class)
        text_chunks = 0
        started = time.perf_counter()
        last_text_at = started
        first_choice_at = None
        try:
            async with self.client.post(
                self.url, json=self.payload(request), headers=self.headers(request)
            ) as response:
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", "replace")
                    result.error_code = error_code(body)
                    return self.failed(result, f"http_{response.status}", error_text(body))
                async for line in response.content:  # one SSE line at a time
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error_code = error_code(data.decode())
                        return self.failed(result, "stream_error", error_text(data.decode()))
                    now = time.perf_counter()
                    if event.get("choices") and first_choice_at is None:
                        first_choice_at = now
                    if chunk_text(event):
                        if text_chunks == 0:
                            result.ttft_s = now - started
                        else:
                            result.itls_s.append(now - last_text_at)
                        text_chunks += 1
                        last_text_at = now
                    usage = event.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        result.output_tokens = usage["completion_tokens"]
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = usage["prompt_tokens"]
        except TimeoutError as error:  # aiohttp's timeouts are asyncio's, i.e. TimeoutError
            return self.failed(result, "timeout", repr(error))
        except aiohttp.ClientError as error:
            return self.failed(result, "connection", repr(error))
        except ValueError as error:  # not JSON, or a line longer than MAX_SSE_LINE_BYTES
            return self.failed(result, "bad_sse", repr(error))
        result.e2el_s = time.perf_counter() - started
        result.output_tokens = result.output_tokens or text_chunks
        if result.output_tokens == 0 or first_choice_at is None:
            return self.failed(result, "empty_output", "the stream carried no output")
        if text_chunks == 0:
            # Tokens were generated but all decoded to nothing visible (e.g. special tokens
            # under ignore_eos); the first choice chunk is then the best first-token time.
            result.ttft_s = first_choice_at - started
        result.success = True
        return result

    @staticmethod
    def failed(result: RequestResult, kind: str, message: str) -> RequestResult:
        result.success, result.error_kind, result.error_message = False, kind, message
        return result


def chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def error_text(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:500]


def error_code(body: str) -> str:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return "" if code is None else str(code)


def percentile_summary(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std and percentiles in ms, with numpy's linear interpolation (as vLLM)."""
    values_ms = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    summary = {
        f"mean_{name}_ms": float(np.mean(values_ms)),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(np.std(values_ms)),
    }
    for percent in PERCENTILES:
        summary[f"p{percent}_{name}_ms"] = float(np.percentile(values_ms, percent))
    return summary


def rejected_late(result: RequestResult) -> bool:
    """Refused by the engine as too late for its targets: a shed request, not a server failure."""
    return not result.success and result.error_code == SLO_LATE


def meets_every_slo(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    if not result.success:
        return False
    measured_ms = {
        "ttft": result.ttft_s * 1000.0,
        "e2el": result.e2el_s * 1000.0,
        # A one-token answer has no time per output token, so it cannot miss a TPOT SLO.
        "tpot": (result.tpot_s or 0.0) * 1000.0,
    }
    return all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def summarize(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]) -> dict:
    succeeded = [result for result in results if result.success]
    input_tokens = sum(result.prompt_len for result in succeeded)
    output_tokens = sum(result.output_tokens for result in succeeded)
    good = sum(1 for result in succeeded if meets_every_slo(result, slos_ms))
    rejected = sum(1 for result in results if rejected_late(result))
    metrics: dict = {
        "completed": len(succeeded),
        "failed": len(results) - len(succeeded) - rejected,
        "rejected": rejected,
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(succeeded) / duration_s,
        "request_goodput": good / duration_s if slos_ms else None,
        "good_requests": good if slos_ms else None,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "errors": dict(sorted(Counter(r.error_kind for r in results
                                      if not r.success and not rejected_late(r)).items())),
    }
    samples = {
        "ttft": [result.ttft_s for result in succeeded],
        "tpot": [result.tpot_s for result in succeeded if result.tpot_s is not None],
        "itl": [gap for result in succeeded for gap in result.itls_s],
        "e2el": [result.e2el_s for result in succeeded],
    }
    for name in LATENCY_METRICS:
        metrics.update(percentile_summary(name, samples[name]))
    return metrics


async def drive(config: BenchConfig, planned: list[PlannedRequest]) -> tuple[list, float, float]:
    """Send the planned requests; returns their results, the run's seconds and its Unix start."""
    gaps = arrival_gaps(
        len(planned), config.request_rate, config.burstiness, random.Random(config.seed + 1)
    )
    limit = config.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    # One pool for the whole run; no cap on it without --max-concurrency (0 = no limit), so
    # the pool never queues requests that the benchmark meant to have in flight.
    connector = aiohttp.TCPConnector(limit=limit or 0)
    # A bound on connecting and on each wait for data, not on a whole (possibly long) stream.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.timeout_s,
                                    sock_read=config.timeout_s)
    progress = tqdm(
        total=len(planned), desc="requests", unit="req", disable=not config.show_progress
    )
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     read_bufsize=MAX_SSE_LINE_BYTES) as client:
        sender = StreamingClient(client, config)

        async def one(request: PlannedRequest) -> RequestResult:
            sent_at_s = time.perf_counter() - started
            if semaphore is None:
                result = await sender.send(request)
            else:
                async with semaphore:
                    result = await sender.send(request)
            result.sent_at_s = sent_at_s
            progress.update(1)
            return result

        started, started_at = time.perf_counter(), time.time()
        tasks = []
        send_at = started
        for gap, request in zip(gaps, planned, strict=True):
            # Sleep to an absolute schedule so per-request overhead does not slow the rate.
            send_at += gap
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    progress.close()
    return list(results), duration, started_at


def run_benchmark(config: BenchConfig) -> dict:
    """Run the whole benchmark and return its metrics (also written to result_json if set)."""
    config.validate()
    planned = PromptPlanner(config).plan()
    results, duration, started_at = asyncio.run(drive(config, planned))
    metrics = summarize(results, duration, config.goodput_slos_ms)
    metrics["started_at"] = started_at  # Unix time of the first send: lines up with other logs
    # When the last request went: the rate actually sent is (requests - 1) / this, not the one asked for.
    metrics["send_span_s"] = max(result.sent_at_s for result in results)
    metrics["config"] = config_summary(config)
    metrics["error_messages"] = first_error_messages(results)
    metrics["input_lens"] = [result.prompt_len for result in results]
    metrics["output_lens"] = [result.output_tokens for result in results]
    metrics["ttfts"] = [result.ttft_s for result in results]
    metrics["e2els"] = [result.e2el_s for result in results]
    if config.request_classes:
        metrics["classes"] = {
            c.name: summarize([r for r in results if r.request_class == c.name], duration,
                              config.goodput_slos_ms)
            for c in config.request_classes
        }
        metrics["request_classes"] = [result.request_class for result in results]
        metrics["sent_at"] = [result.sent_at_s for result in results]
        metrics["error_kinds"] = [result.error_kind for result in results]
        metrics["error_codes"] = [result.error_code for result in results]
    if config.result_json:
        Path(config.result_json).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


# ---------------------------------------------------------------------------- goodput curves

# Each step's prompts are drawn with a seed of its own: the same prompts again would hit the
# server's prefix cache and make the later (busier) steps look faster than they are.
STEP_SEED_STRIDE = 1000


def validate_curve(rates: list[float], step_s: float) -> None:
    if not rates:
        raise BenchConfigError("rates: give at least one request rate")
    if len(rates) > MAX_CURVE_STEPS:
        raise BenchConfigError(f"rates: at most {MAX_CURVE_STEPS} steps, got {len(rates)}")
    if not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise BenchConfigError("rates: every rate must be a finite number of requests per second > 0")
    if any(later <= earlier for earlier, later in zip(rates, rates[1:], strict=False)):
        raise BenchConfigError("rates: must rise from step to step (e.g. 1,2,4,8)")
    if not (math.isfinite(step_s) and step_s > 0):
        raise BenchConfigError("step-seconds: must be a finite number of seconds > 0")


def curve_point(rate: float, metrics: dict) -> dict:
    """One step of a curve, as the capacity planner stores it. A latency with nothing measured is
    None (no request completed; no answer longer than one token), never a made-up 0. `sent_rps`: the
    rate the step actually sent, where it sent more than one request."""
    completed = metrics["completed"]
    tpot_measured = completed and any(tokens > 1 for tokens in metrics["output_lens"])
    sent = len(metrics["output_lens"])
    point = {
        "rps": rate,
        "throughput_rps": metrics["request_throughput"],
        "goodput_rps": metrics["request_goodput"],
        "ttft_p95_ms": metrics["p95_ttft_ms"] if completed else None,
        "tpot_p95_ms": metrics["p95_tpot_ms"] if tpot_measured else None,
        "completed": completed,
        "failed": metrics["failed"] + metrics["rejected"],
    }
    if sent > 1 and metrics["send_span_s"] > 0:
        # A short Poisson step sends more or fewer requests a second than asked, by far more than 5 %.
        point["sent_rps"] = (sent - 1) / metrics["send_span_s"]
    return point


def run_curve(config: BenchConfig, rates: list[float], step_s: float) -> list[dict]:
    """One benchmark step per rate (rising), each a Poisson run at that rate of rate × step_s
    requests that ends when its last request does; returns the steps' points (`curve_point`)."""
    validate_curve(rates, step_s)
    config.validate()
    points = []
    steps = tqdm(rates, desc="steps", unit="step", disable=not config.show_progress)
    for index, rate in enumerate(steps):
        steps.set_description(f"step {index + 1}/{len(rates)} at {rate:g} req/s")
        step = replace(config, request_rate=rate, num_prompts=max(1, round(rate * step_s)),
                       seed=config.seed + STEP_SEED_STRIDE * index, result_json=None, show_progress=False)
        point = curve_point(rate, run_benchmark(step))
        points.append(point)
        steps.set_postfix_str(f"{point['throughput_rps']:.2f} req/s done, TTFT p95 "
                              f"{_ms(point['ttft_p95_ms'])}")
    steps.close()
    if config.result_json:
        result = {"config": config_summary(config), "rates": rates, "step_s": step_s, "points": points}
        Path(config.result_json).write_text(json.dumps(result, indent=2) + "\n")
    return points


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def format_curve(points: list[dict]) -> str:
    columns = ("offered req/s", "throughput", "goodput", "TTFT p95 ms", "TPOT p95 ms", "completed", "failed")
    lines = ["{s:{c}^96}".format(s=" Goodput Curve ", c="="), "".join(f"{name:>14}" for name in columns)]
    for point in points:
        cells = [point["rps"], point["throughput_rps"], point["goodput_rps"], point["ttft_p95_ms"],
                 point["tpot_p95_ms"], point["completed"], point["failed"]]
        lines.append("".join(f"{'-' if cell is None else f'{cell:.2f}' if isinstance(cell, float) else cell:>14}"
                             for cell in cells))
    lines.append("=" * 96)
    return "\n".join(lines)


def parse_rates(text: str) -> list[float]:
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise BenchConfigError(f"rates={text!r}: expected request rates separated by commas, e.g. 1,2,4,8") from None


def config_summary(config: BenchConfig) -> dict:
    summary = asdict(config)
    summary.pop("api_key")
    summary["request_classes"] = [
        {"name": c.name, "share": c.share} for c in config.request_classes
    ]
    summary.pop("show_progress")
    summary["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    summary["input_len"] = f"{config.input_len.low}-{config.input_len.high}"
    summary["output_len"] = f"{config.output_len.low}-{config.output_len.high}"
    return summary


def first_error_messages(results: list[RequestResult]) -> dict[str, str]:
    messages: dict[str, str] = {}
    for result in results:
        if not result.success:
            messages.setdefault(result.error_kind, result.error_message)
    return messages


def format_report(metrics: dict) -> str:
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{metrics['completed']}"),
        ("Failed requests:", f"{metrics['failed']}"),
        *([("Rejected as late (503 slo_late):", f"{metrics['rejected']}")] if metrics.get("rejected") else []),
        ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
        ("Total input tokens:", f"{metrics['total_input_tokens']}"),
        ("Total generated tokens:", f"{metrics['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
    ]
    if metrics["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{metrics['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{label:<44}{value:>16}" for label, value in rows]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^60}".format(s=f" {titles[name]} ", c="-"))
        for statistic in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            label = f"{statistic.capitalize() if statistic[0] != 'p' else statistic.upper()} "
            label += f"{name.upper()} (ms):"
            lines.append(f"{label:<44}{metrics[f'{statistic}_{name}_ms']:>16.2f}")
    if metrics["errors"]:
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        lines += [f"{kind:<44}{count:>16}" for kind, count in metrics["errors"].items()]
    lines.append("=" * 60)
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        try:
            slos[name.strip().lower()] = float(value)
        except ValueError:
            raise BenchConfigError(f"goodput: {item!r} is not METRIC:MS") from None
    return slos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8001")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "none"),
        help="bearer token (default: $OPENAI_API_KEY or 'none')",
    )
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, or inf to send all at once (default inf)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps; 1.0 is Poisson, lower is burstier",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", default="64", help="N or LOW-HIGH (default 64)")
    parser.add_argument("--output-len", default="64", help="N or LOW-HIGH (default 64)")
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="length of a prefix put before each prompt's random part",
    )
    parser.add_argument(
        "--shared-prefix-ratio",
        type=float,
        default=1.0,
        help="fraction of requests that share the prefix (default 1.0)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sent with each request (default 0: greedy)"
    )
    parser.add_argument("--top-p", type=float, default=None, help="sent with each request if set")
    parser.add_argument("--top-k", type=int, default=None, help="sent with each request if set")
    for name in ("frequency", "presence", "repetition"):
        parser.add_argument(f"--{name}-penalty", type=float, default=None,
                            help="sent with each request if set")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="folder with tokenizer.json: build prompts to exact token lengths",
    )
    parser.add_argument(
        "--rates", "--request-rates",
        type=parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="measure a goodput curve: one step per rate (rising req/s); replaces --request-rate "
             "and --num-prompts",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=20.0,
        help="with --rates: seconds of arrivals per step (rate x seconds requests; default 20)",
    )
    parser.add_argument("--priority", type=int, default=None,
                        help="the built-in engine's scheduling priority, sent with each request if set")
    parser.add_argument("--result-json", default=None, metavar="FILE")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to ignore EOS so outputs have the asked length",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=LengthRange.parse(args.input_len, "input-len"),
        output_len=LengthRange.parse(args.output_len, "output-len"),
        shared_prefix_len=args.shared_prefix_len,
        shared_prefix_ratio=args.shared_prefix_ratio,
        goodput_slos_ms=parse_goodput(args.goodput),
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        priority=args.priority,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        tokenizer_dir=args.tokenizer,
        result_json=args.result_json,
    )


def execute(args: argparse.Namespace) -> tuple[int, BenchConfig, dict | list[dict]]:
    """Run what the options ask for and print its report: (exit code, config, the metrics, or the
    curve's points with --rates). Exit 1 when no request completed (in no step, for a curve)."""
    try:
        config = config_from_args(args)
        if args.rates is not None:
            points = run_curve(config, args.rates, args.step_seconds)
        else:
            metrics = run_benchmark(config)
    except BenchConfigError as error:
        raise SystemExit(f"inferops bench: {error}") from None
    if args.rates is not None:
        print(format_curve(points))
        result: dict | list[dict] = points
        completed = sum(point["completed"] for point in points)
    else:
        print(format_report(metrics))
        result, completed = metrics, metrics["completed"]
    if config.result_json:
        print(f"results written to {config.result_json}")
    return (0 if completed else 1), config, result


def main(args: argparse.Namespace) -> int:
    return execute(args)[0]
