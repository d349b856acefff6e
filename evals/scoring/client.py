"""An eval run's view of one replica, over its OpenAI-compatible API (the built-in engine or
vLLM): greedy generations, and continuations' log-likelihoods as lm-evaluation-harness computes
them for an API model, so a `choice` score here is the harness's score on the same replica.

`base_url` is the server's root, where `/v1/completions` and `/tokenize` live (a trailing
`/v1` is dropped). A replica that is busy (503) or drops the connection is asked again after a
short backoff; anything else is a `ReplicaError` that says what the replica answered."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

# Backoff before each retry of a request the replica could not take (connection lost, 503).
RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0)
DEFAULT_MAX_TOKENS = 64
# Greedy answers are the same every time; a seed makes any sampling the engine still does so too.
SEED = 0


@dataclass(frozen=True)
class Generation:
    """A greedy answer: its text, its tokens as logprobs name them, usage and latency."""

    text: str
    tokens: list[str]
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float


@dataclass(frozen=True)
class Continuations:
    """Each continuation's summed log-likelihood after the context, with what scoring them cost."""

    loglikelihoods: list[float]
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float


class ReplicaError(Exception):
    """The replica refused or failed a request (`status`), or could not be reached (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ReplicaClient:
    def __init__(self, base_url: str, model: str, *, priority: int | None,
                 timeout_s: float = 120.0) -> None:
        root = base_url.rstrip("/")
        self.base_url = root[:-len("/v1")] if root.endswith("/v1") else root
        self.model = model
        self.priority = priority  # None for vLLM, which takes no priority field
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- generations ----------------------------------------------------------------------

    async def greedy(self, case: dict) -> Generation:
        """The case's greedy answer: chat for `messages`, a completion for `prompt`."""
        body: dict[str, Any] = {"model": self.model, "temperature": 0, "seed": SEED,
                                "max_tokens": case.get("max_tokens") or DEFAULT_MAX_TOKENS}
        if self.priority is not None:
            body["priority"] = self.priority
        if "messages" in case:
            answer, latency_ms = await self._timed_post(
                "/v1/chat/completions",
                {**body, "messages": case["messages"], "logprobs": True, "top_logprobs": 0})
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
            tokens = [entry["token"] for entry in (choice.get("logprobs") or {}).get("content")
                      or []]
        else:
            answer, latency_ms = await self._timed_post(
                "/v1/completions", {**body, "prompt": case["prompt"], "logprobs": 0})
            choice = answer["choices"][0]
            text = choice["text"]
            tokens = list((choice.get("logprobs") or {}).get("tokens") or [])
        usage = answer.get("usage") or {}
        return Generation(text=text, tokens=tokens,
                          prompt_tokens=usage.get("prompt_tokens", 0),
                          completion_tokens=usage.get("completion_tokens", 0),
                          latency_ms=latency_ms)

    # -- log-likelihoods ------------------------------------------------------------------

    async def loglikelihoods(self, context: str | list[dict],
                             continuations: list[str]) -> list[float]:
        """The summed log-likelihood of each continuation after `context`."""
        return (await self.score_continuations(context, continuations)).loglikelihoods

    async def score_continuations(self, context: str | list[dict],
                                  continuations: list[str]) -> Continuations:
        """lm-evaluation-harness's loglikelihood requests for an API model, one per
        continuation: the context's trailing whitespace moves onto the continuation, the
        continuation's tokens are those the joined text adds after the context's, and the
        prompt (left-truncated to the context length, less the one token generated) is sent as
        token ids with echo and logprobs, its continuation positions summed.

        A chat `context` (messages) is tokenized through the replica's chat template; there is
        no text to join a continuation to, so a continuation is then tokenized on its own."""
        started = time.perf_counter()
        scored = await asyncio.gather(*(self._score_one(context, c) for c in continuations))
        return Continuations(loglikelihoods=[ll for ll, _ in scored],
                             prompt_tokens=sum(usage.get("prompt_tokens", 0)
                                               for _, usage in scored),
                             completion_tokens=sum(usage.get("completion_tokens", 0)
                                                   for _, usage in scored),
                             latency_ms=(time.perf_counter() - started) * 1000)

    async def _score_one(self, context: str | list[dict],
                         continuation: str) -> tuple[float, dict]:
        context_enc, continuation_enc, max_model_len = await self._encode_pair(context,
                                                                              continuation)
        # One token is generated (and dropped), so the prompt leaves it room, as lm-eval does.
        max_length = max_model_len - 1
        whole = context_enc + continuation_enc
        prompt = whole[-max_length:]
        context_len = len(context_enc) - max(0, len(whole) - max_length)
        answer = await self._post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "seed": SEED, "logprobs": 1, "echo": True,
            **({"priority": self.priority} if self.priority is not None else {})})
        token_logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
        return sum(token_logprobs[context_len:len(prompt)]), answer.get("usage") or {}

    async def _encode_pair(self, context: str | list[dict],
                           continuation: str) -> tuple[list[int], list[int], int]:
        if isinstance(context, list):
            context_enc, max_model_len = await self.tokenize(messages=context)
            continuation_enc, _ = await self.tokenize(continuation, add_special_tokens=False)
            return context_enc, continuation_enc, max_model_len
        if context == "":  # lm-eval conditions on BOS (the tokenizer's prefix) instead
            continuation_enc, max_model_len = await self.tokenize(continuation,
                                                                  add_special_tokens=False)
            prefix, _ = await self.tokenize("", add_special_tokens=True)
            if not prefix:
                raise ValueError("An empty context needs a tokenizer that adds a BOS token.")
            if continuation_enc and continuation_enc[0] == prefix[0]:
                return continuation_enc[:1], continuation_enc[1:], max_model_len
            return prefix[:1], continuation_enc, max_model_len
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        (context_enc, max_model_len), (whole_enc, _) = await asyncio.gather(
            self.tokenize(context, add_special_tokens=False),
            self.tokenize(context + continuation, add_special_tokens=False))
        return context_enc, whole_enc[len(context_enc):], max_model_len

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       add_special_tokens: bool | None = None) -> tuple[list[int], int]:
        """Token ids from the replica's /tokenize (vLLM's route), and its max_model_len."""
        body: dict[str, Any] = {"model": self.model}
        if messages is not None:
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        answer = await self._post("/tokenize", body)
        return list(answer["tokens"]), int(answer["max_model_len"])

    # -- HTTP -----------------------------------------------------------------------------

    async def _timed_post(self, path: str, body: dict) -> tuple[dict, float]:
        started = time.perf_counter()
        answer = await self._post(path, body)
        return answer, (time.perf_counter() - started) * 1000

    async def _post(self, path: str, body: dict) -> dict:
        for delay in RETRY_DELAYS_S:
            answer = await self._attempt(path, body, last=False)
            if answer is not None:
                return answer
            await asyncio.sleep(delay)
        answer = await self._attempt(path, body, last=True)
        assert answer is not None  # the last attempt answers or raises
        return answer

    async def _attempt(self, path: str, body: dict, *, last: bool) -> dict | None:
        """The replica's answer; None when it could not take the request and `last` is not set."""
        url = f"{self.base_url}{path}"
        try:
            response = await self._http.post(path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                httpx.RemoteProtocolError) as exc:
            if not last:
                return None
            raise ReplicaError(f"{url}: unreachable after {len(RETRY_DELAYS_S) + 1} attempts: "
                               f"{exc!r}") from exc
        except httpx.TimeoutException as exc:  # a slow answer is not retried: it would pile up
            raise ReplicaError(f"{url}: no answer within {self._http.timeout.read} s") from exc
        if response.status_code == 503 and not last:
            return None
        if response.status_code != 200:
            raise ReplicaError(f"{url} answered {response.status_code}: "
                               f"{error_message(response)}", response.status_code)
        return response.json()


def error_message(response: httpx.Response) -> str:
    """The OpenAI-style error's message, or the start of whatever else the body was."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300] or response.reason_phrase
