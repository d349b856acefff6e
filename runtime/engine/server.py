"""`inferops serve`: an OpenAI-compatible replica around the built-in engine.

The process binds at once and answers /health 503 while the model loads in a background
thread, so an orchestrator can watch it come up. SIGTERM drains: /health and new requests get
503, in-flight requests finish (bounded by --drain-timeout), then the process exits 0.

Fault injection (extra TTFT, extra time per output token, a fraction of requests answered
500) is off by default and exists for tests and game days; the delays are applied per request
in the async layer, so they never slow the engine loop or other requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.engine.async_engine import (
    FAILED,
    LOADING,
    READY,
    STOPPED,
    AsyncEmbedder,
    AsyncEngine,
    EngineEvent,
    EngineUnavailableError,
    RequestStream,
)
from runtime.engine.config import (
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    OPS_BACKENDS,
    GenerationDefaults,
)
from runtime.engine.metrics import DEFAULT_BUCKETS, RequestTimer, ServerMetrics
from runtime.engine.openai_protocol import (
    ChoiceResult,
    GenerationRequest,
    OpenAIError,
    ResponseShapes,
    bad_request,
    embedding_response,
    new_request_id,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    usage_body,
)

if TYPE_CHECKING:  # sampling.py imports torch, which loads in the model thread
    from runtime.engine.sampling import TokenLogprob

logger = logging.getLogger("inferops.serve")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
LONG_PROMPT_CHARS = 32 * 1024
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------------------------------------
# Settings and run-time state


@dataclass
class FaultSettings:
    """Injected faults; changeable at run time through POST /admin/faults."""

    fault_ttft_ms: float = 0.0
    fault_tpot_ms: float = 0.0
    fault_error_rate: float = 0.0

    def update(self, body: Any) -> None:
        """Validate every field first so a bad update changes nothing."""
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", "body")
        unknown = set(body) - set(asdict(self))
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"Unrecognized fault setting `{name}`.", name)
        changes = {}
        for name, value in body.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"`{name}` must be a number.", name)
            if value < 0 or (name == "fault_error_rate" and value > 1):
                limit = "between 0 and 1" if name == "fault_error_rate" else ">= 0"
                raise bad_request(f"`{name}` must be {limit}, got {value}.", name)
            changes[name] = float(value)
        for name, value in changes.items():
            setattr(self, name, value)

    def draw_error(self) -> bool:
        return self.fault_error_rate > 0 and random.random() < self.fault_error_rate


@dataclass
class ServerSettings:
    served_model_name: str
    model_root: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_token: str | None = None
    faults: FaultSettings = field(default_factory=FaultSettings)
    histogram_buckets: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # What a request leaves out: OpenAI's defaults or the checkpoint's generation_config.json.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


class Lifecycle:
    """Counts requests in flight and knows whether the replica is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait for in-flight requests. True when all of them finished."""
        self.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.in_flight == 0


class AdmissionMiddleware:
    """Refuses model requests while draining and counts the admitted ones until the last byte
    of their response is sent (a streamed response outlives its endpoint function)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            error = OpenAIError(503, "The server is shutting down; retry on another replica.")
            await error_response(error)(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


# The engine failed one request (finish_reason "error") and goes on serving the others.
NON_FINITE_LOGITS = (
    "The model's logits for this request were NaN or infinite, so no token could be chosen. "
    "The checkpoint's weights may be broken, or its numbers overflow in this dtype: try "
    "serving it with --dtype float32.")


def unavailable_error(exc: EngineUnavailableError) -> OpenAIError:
    """Loading and shutting down are temporary (503, retry elsewhere); a dead or failed
    model is a server error (500)."""
    return OpenAIError(503 if exc.state in (LOADING, STOPPED) else 500, str(exc))


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def read_json_body(request: Request, limit: int) -> Any:
    """Reads the body, refusing it as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = OpenAIError(413, f"The request body exceeds the limit of {limit} bytes.", "body")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a missing or lying Content-Length must not get past the limit
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"Malformed JSON body: {exc}", "body") from None


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Runs `work`, cancelling it if the client disconnects first (aborting its request)."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server itself is cancelling this request
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


class ClientDisconnected(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# The application


class ReplicaServer:
    """The HTTP endpoints of one replica serving one model."""

    def __init__(self, backend: AsyncEngine | AsyncEmbedder, settings: ServerSettings) -> None:
        self.backend = backend
        self.settings = settings
        self.faults = settings.faults
        self.lifecycle = Lifecycle()
        self.metrics = ServerMetrics(settings.served_model_name, backend.stats,
                                     settings.histogram_buckets)
        self.started_at = int(time.time())

    def build_app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/admin/faults", self.admin_faults, methods=["GET", "POST"]),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.backend.start(asyncio.get_running_loop())
            yield
            await asyncio.to_thread(self.backend.stop)

        app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
            OpenAIError: self._openai_error,
            HTTPException: self._http_error,
            Exception: self._unexpected_error,
        })
        app.add_middleware(AdmissionMiddleware, lifecycle=self.lifecycle)
        return app

    # -- error handlers -------------------------------------------------------------------

    async def _openai_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = "Not found." if exc.status_code == 404 else str(exc.detail)
        return error_response(OpenAIError(exc.status_code, message))

    async def _unexpected_error(self, request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(OpenAIError(500, "Internal server error."))

    # -- operational endpoints ------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.backend.state != READY:
            body = {"status": self.backend.state}
            if self.backend.error:
                body["error"] = self.backend.error
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        max_model_len = None
        if isinstance(self.backend, AsyncEngine) and self.backend.ready:
            max_model_len = self.backend.max_model_len
        card = {
            "id": self.settings.served_model_name, "object": "model",
            "created": self.started_at, "owned_by": "inferops",
            "root": self.settings.model_root, "parent": None, "max_model_len": max_model_len,
            "permission": [{
                "id": f"modelperm-{self.settings.served_model_name}",
                "object": "model_permission", "created": self.started_at,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def admin_faults(self, request: Request) -> Response:
        self._authorize_admin(request)
        if request.method == "POST":
            self.faults.update(await read_json_body(request, self.settings.max_body_bytes))
            logger.warning("fault injection changed: %s", asdict(self.faults))
        return JSONResponse(asdict(self.faults))

    def _authorize_admin(self, request: Request) -> None:
        token = self.settings.admin_token
        if not token:
            raise OpenAIError(404, "The admin API is disabled (no admin token configured).")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise OpenAIError(401, "A valid admin bearer token is required.")

    # -- model endpoints ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion_request)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat_request)

    async def embeddings(self, request: Request) -> Response:
        body = await read_json_body(request, self.settings.max_body_bytes)
        parsed = parse_embedding_request(body)
        self._check_model(parsed.model)
        if not isinstance(self.backend, AsyncEmbedder):
            raise bad_request("This model does not support the Embeddings API.", "model")
        self._check_ready()
        self._maybe_inject_error()
        try:
            vectors, counts = await self.backend.embed(parsed.inputs)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), "input") from None
        except EngineUnavailableError as exc:
            raise unavailable_error(exc) from None
        return JSONResponse(embedding_response(self.settings.served_model_name, vectors, counts,
                                               parsed.encoding_format))

    async def _generate(self, request: Request,
                        parse: Callable[[Any, GenerationDefaults], GenerationRequest]
                        ) -> Response:
        timer = self.metrics.start_request()  # TTFT and E2E count from arrival
        body = await read_json_body(request, self.settings.max_body_bytes)
        parsed = parse(body, self.settings.generation_defaults)
        self._check_model(parsed.model)
        if not isinstance(self.backend, AsyncEngine):
            raise bad_request("This model only supports the Embeddings API.", "model")
        self._check_ready()
        self._maybe_inject_error()
        prompt_ids = await self._tokenize(parsed)
        max_tokens = self._checked_max_tokens(parsed, len(prompt_ids))
        try:
            params = parsed.sampling_params(max_tokens)
        except ValueError as exc:  # SamplingParams' own checks, should ours ever miss one
            raise bad_request(str(exc)) from None
        request_id = new_request_id(parsed.kind)
        shapes = ResponseShapes(parsed.kind, request_id, self.settings.served_model_name,
                                self.backend.tokenizer.token_text)
        echo = None
        if parsed.echo:  # the prompt as sent, or as its token ids read
            echo = parsed.prompt_text if parsed.prompt_text is not None \
                else self.backend.tokenizer.decode(prompt_ids)
        run = GenerationRun(self, timer, request_id, prompt_ids, params, parsed.priority,
                            echo, parsed.echo_only)
        headers = {"X-Request-Id": request_id}
        try:
            if parsed.stream:
                # Submitted before the headers go out, so a refusal is still a plain 400.
                await run.start()
                return StreamingResponse(run.stream(shapes, parsed.include_usage),
                                         media_type="text/event-stream",
                                         headers={**SSE_HEADERS, **headers},
                                         # runs even when a disconnect cut the stream short
                                         background=BackgroundTask(run.close))
            choices = await cancel_on_disconnect(request, run.collect())
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        except EngineUnavailableError as exc:
            raise unavailable_error(exc) from None
        except ValueError as exc:  # the engine refused the request (InvalidRequest names why)
            raise bad_request(str(exc), getattr(exc, "param", None)) from None
        choices = [run.as_sent(c) for c in choices]
        usage = usage_body(len(prompt_ids), sum(c.num_output_tokens for c in choices))
        return JSONResponse(shapes.response(choices, usage), headers=headers)

    def _check_model(self, model: str | None) -> None:
        name = self.settings.served_model_name
        if model is not None and model != name:
            raise OpenAIError(404, f"The model `{model}` does not exist. Available: {name}.",
                              "model")

    def _check_ready(self) -> None:
        if self.backend.state != READY:
            raise unavailable_error(EngineUnavailableError(self.backend.state,
                                                           self.backend.error))

    def _maybe_inject_error(self) -> None:
        if self.faults.draw_error():
            self.metrics.request_success["error"].inc()
            raise OpenAIError(500, "Injected fault: this request was failed on purpose "
                                   "(fault_error_rate).")

    async def _tokenize(self, parsed: GenerationRequest) -> list[int]:
        """Token ids of the prompt; long prompts are tokenized off the event loop so they do
        not stall every other stream (this helps as far as the tokenizer releases the GIL)."""
        text_size = len(parsed.prompt_text or "") + sum(
            len(m["content"]) for m in parsed.messages or [])
        if text_size > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(self._prompt_token_ids, parsed)
        return self._prompt_token_ids(parsed)

    def _prompt_token_ids(self, parsed: GenerationRequest) -> list[int]:
        assert isinstance(self.backend, AsyncEngine)
        tokenizer = self.backend.tokenizer
        if parsed.prompt_token_ids is not None:
            return parsed.prompt_token_ids
        if parsed.prompt_text is not None:
            return list(tokenizer.encode(parsed.prompt_text, add_special_tokens=True))
        # OpenAI's "developer" role is the newer name for "system"; templates know the latter.
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                    for m in parsed.messages or []]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # jinja2 raise_exception and template errors are input errors
            raise bad_request(f"The chat template rejected the messages: {exc}",
                              "messages") from None
        # The template writes the special tokens (BOS) itself.
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _checked_max_tokens(self, parsed: GenerationRequest, num_prompt_tokens: int) -> int:
        assert isinstance(self.backend, AsyncEngine)
        max_model_len = self.backend.max_model_len
        if num_prompt_tokens == 0:
            raise bad_request("The prompt is empty.", "prompt")
        if parsed.max_tokens is None:  # chat default: whatever room the context leaves
            if num_prompt_tokens >= max_model_len:
                raise self._too_long(max_model_len, num_prompt_tokens, 1, "messages")
            return max_model_len - num_prompt_tokens
        # Echoing the prompt alone still samples one token, which is not sent.
        max_tokens = max(parsed.max_tokens, 1)
        if num_prompt_tokens + max_tokens > max_model_len:
            raise self._too_long(max_model_len, num_prompt_tokens, max_tokens, "max_tokens")
        return max_tokens

    @staticmethod
    def _too_long(max_model_len: int, prompt: int, completion: int, param: str) -> OpenAIError:
        return bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt + completion} tokens ({prompt} in the prompt, {completion} in "
            f"the completion). Please reduce the prompt or max_tokens.", param)


class GenerationRun:
    """One admitted generation request: engine events with faults and metrics applied.

    `echo` is the prompt's text when the client asked for it back (completions' `echo`), in
    front of each choice's text and, with logprobs, its tokens' logprobs in front of the
    choice's; `echo_only` (max_tokens 0) sends nothing else."""

    def __init__(self, server: ReplicaServer, timer: RequestTimer, request_id: str,
                 prompt_ids: list[int], params: Any, priority: int, echo: str | None = None,
                 echo_only: bool = False) -> None:
        self.server = server
        self.timer = timer
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.priority = priority
        self.echo = echo
        self.echo_only = echo_only
        self.prompt_logprobs: list[TokenLogprob] | None = None  # from the first output
        self.choices = [ChoiceResult(index=i) for i in range(params.n)]
        self.engine_stream: RequestStream | None = None

    def as_sent(self, choice: ChoiceResult) -> ChoiceResult:
        """A whole choice as the client gets it: with the echoed prompt in front."""
        if self.echo is None:
            return choice
        if self.echo_only:
            return ChoiceResult(choice.index, self.echo, "length", 0, self.prompt_logprobs)
        logprobs = (None if choice.logprobs is None
                    else (self.prompt_logprobs or []) + choice.logprobs)
        return replace(choice, text=self.echo + choice.text, logprobs=logprobs)

    async def start(self) -> None:
        engine = self.server.backend
        assert isinstance(engine, AsyncEngine)
        try:
            self.engine_stream = await engine.submit(self.request_id, self.prompt_ids,
                                                     self.params, self.priority)
        except EngineUnavailableError:
            self.timer.on_finished("error")
            raise

    def close(self) -> None:
        """Abort the request if it is still running; counted as aborted."""
        if self.engine_stream is not None and not self.engine_stream.done:
            self.engine_stream.close()
            self.timer.on_finished("abort")

    async def events(self) -> AsyncIterator[EngineEvent]:
        if self.engine_stream is None:
            await self.start()
        assert self.engine_stream is not None
        faults = self.server.faults
        outcome = "abort"  # unless the loop below runs to its end
        try:
            async for event in self.engine_stream:
                output = event.output
                num_new = len(output.new_token_ids)
                if num_new:
                    self.timer.on_scheduled(event.step_started_at)
                    delay_ms = (faults.fault_ttft_ms if self.timer.first_token_at is None
                                else faults.fault_tpot_ms * num_new)
                    if delay_ms > 0:
                        await asyncio.sleep(delay_ms / 1000)
                    self.timer.on_tokens(num_new)
                if output.finish_reason == "error":
                    outcome = "error"
                    raise OpenAIError(500, NON_FINITE_LOGITS)
                choice = self.choices[output.index]
                choice.text += output.new_text
                choice.num_output_tokens += num_new
                if output.logprobs is not None:
                    if choice.logprobs is None:
                        choice.logprobs = []
                    choice.logprobs.extend(output.logprobs)
                if output.prompt_logprobs is not None:
                    self.prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    choice.finish_reason = output.finish_reason
                    choice.stop_reason = output.stop_reason
                yield event
            reasons = [c.finish_reason or "stop" for c in self.choices]
            outcome = "length" if "length" in reasons else reasons[0]
        except EngineUnavailableError as exc:
            outcome = "abort" if exc.state == STOPPED else "error"
            raise
        finally:
            self.timer.on_finished(outcome)

    async def collect(self) -> list[ChoiceResult]:
        async for _ in self.events():
            pass
        return self.choices

    async def stream(self, shapes: ResponseShapes, include_usage: bool) -> AsyncIterator[str]:
        opened: set[int] = set()
        try:
            async for event in self.events():
                output = event.output
                if output.index not in opened:
                    opened.add(output.index)
                    role_chunk = shapes.stream_role_chunk(output.index)
                    if role_chunk is not None:
                        yield sse(role_chunk)
                    if self.echo is not None:
                        yield sse(shapes.stream_chunk(
                            output.index, self.echo, "length" if self.echo_only else None,
                            self.prompt_logprobs if self.params.logprobs is not None
                            else None))
                if self.echo_only:
                    continue
                # A token whose text is held back (a partial character, a possible stop
                # string) still gets its chunk when it brings logprobs, so none is lost.
                if output.new_text or output.finished or output.logprobs:
                    yield sse(shapes.stream_chunk(output.index, output.new_text,
                                                  output.finish_reason if output.finished
                                                  else None, output.logprobs,
                                                  output.stop_reason))
        except (EngineUnavailableError, OpenAIError) as exc:
            # Headers are gone already; vLLM reports mid-stream failures as an error event.
            error = unavailable_error(exc) if isinstance(exc, EngineUnavailableError) else exc
            yield sse(error.body())
            yield "data: [DONE]\n\n"
            return
        except Exception:  # a bug: log it, but still end the stream the way clients expect
            logger.exception("stream %s failed", self.request_id)
            yield sse(OpenAIError(500, "Internal server error.").body())
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            completion_tokens = sum(self.as_sent(c).num_output_tokens for c in self.choices)
            yield sse(shapes.stream_usage_chunk(usage_body(len(self.prompt_ids),
                                                           completion_tokens)))
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# Process: loading, serving, draining


def is_encoder_checkpoint(model_dir: str | Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the loader reports a missing or broken config with a better message
    architectures = config.get("architectures") or []
    return config.get("model_type") == "bert" or any(
        str(a).startswith("Bert") for a in architectures)


def _limit_cpu_threads(num_threads: int | None) -> None:
    """Called in the model thread, which runs every forward pass: OpenMP's thread count is a
    per-calling-thread setting."""
    if num_threads:
        import torch
        torch.set_num_threads(num_threads)


def build_backend(args: argparse.Namespace) -> AsyncEngine | AsyncEmbedder:
    """The model is loaded later, in the backend's thread, so the server can bind first."""
    if is_encoder_checkpoint(args.model):
        def load_encoder() -> Any:
            from runtime.engine.encoder import EmbeddingModel
            _limit_cpu_threads(args.cpu_threads)
            # Encoders are small; "auto" keeps them in float32 for exact vectors on CPU.
            return EmbeddingModel.load(args.model,
                                       "float32" if args.dtype == "auto" else args.dtype)
        return AsyncEmbedder(load_encoder)

    def load_engine() -> Any:
        from runtime.engine.config import EngineConfig
        from runtime.engine.engine import LLMEngine
        _limit_cpu_threads(args.cpu_threads)
        return LLMEngine(EngineConfig(
            model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
            linear_backend=args.linear_backend, ops_backend=args.ops_backend,
            kv_cache_dtype=args.kv_cache_dtype))
    return AsyncEngine(load_engine)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before shutting down; a second one
    stops at once. A model that fails to load ends the process with exit code 1."""

    def __init__(self, config: uvicorn.Config, replica: ReplicaServer,
                 drain_timeout: float) -> None:
        super().__init__(config)
        self.replica = replica
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._exit_if_load_fails())
        await super().serve(sockets)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Unlike uvicorn's handler this does not re-raise the signal after shutdown: a
        # drained replica exits 0.
        if self.replica.lifecycle.draining or not self.started or self._loop is None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        logger.info("received %s: draining (up to %.0f s)", signal.Signals(sig).name,
                    self.drain_timeout)
        self.replica.lifecycle.draining = True  # /health says 503 from this instant
        self._loop.call_soon_threadsafe(self._spawn, self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        lifecycle = self.replica.lifecycle
        if not await lifecycle.drain(self.drain_timeout):
            logger.warning("drain timeout: ending %d request(s) still in flight",
                           lifecycle.in_flight)
            backend = self.replica.backend
            if isinstance(backend, AsyncEngine):
                # Streams end with an error event and [DONE] instead of a cut connection.
                backend.interrupt_all(EngineUnavailableError(STOPPED))
            await lifecycle.drain(1.0)
        self.should_exit = True

    async def _exit_if_load_fails(self) -> None:
        backend = self.replica.backend
        while backend.state == LOADING:
            await asyncio.sleep(0.1)
        if backend.state == FAILED:
            logger.error("model failed to load: %s", backend.error)
            self.exit_code = 1
            self.should_exit = True


def _size_in_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper().rstrip("B")
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "KI": 1, "MI": 2, "GI": 3, "TI": 4}
    base = 1024 if unit.endswith("I") or unit == "" else 1000
    return int(number * base ** powers[unit])


def _buckets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of seconds: {text!r}") from None
    if not values or list(values) != sorted(set(values)) or values[0] <= 0:
        raise argparse.ArgumentTypeError("buckets must be positive and strictly increasing")
    return values


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends a real default to the help text; None/False defaults say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        silent = action.default is None or action.default is False \
            or action.default == argparse.SUPPRESS
        if not silent and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelpFormatter
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8001, help="port to bind")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as `model` (default: the directory name)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (auto follows the checkpoint, but loads a bf16 "
                             "or fp16 one in float32 on a CPU without native matmuls in that "
                             "dtype); with bfloat16 and the compiled kernels, activations "
                             "stay float32 and only the matmuls run in bf16")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="what the KV cache stores (auto: the weights' dtype, as vLLM); "
                             "bfloat16 holds twice the tokens of float32 in the same memory")
    engine.add_argument("--max-num-seqs", type=int, default=64,
                        help="most sequences in one batch")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="token budget of one step (prefill chunks plus decodes)")
    engine.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                        help="prefill tokens a step may add while decodes run (default: the "
                             "whole --max-num-batched-tokens); lower trades TTFT for TPOT")
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV cache size in blocks (overrides --kv-cache-memory)")
    engine.add_argument("--kv-cache-memory", type=_size_in_bytes, default=None,
                        help="KV cache size, e.g. 512MiB (default: the engine's)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the checkpoint's)")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse KV blocks of shared prompt prefixes")
    engine.add_argument("--no-generation-config", action="store_true",
                        help="ignore the checkpoint's generation_config.json: requests that "
                             "leave out temperature, top_p, top_k, min_p or repetition_penalty "
                             "get OpenAI's defaults")
    engine.add_argument("--seed", type=int, default=0,
                        help="seed for requests that bring none")
    engine.add_argument("--cpu-threads", type=int, default=None,
                        help="torch intra-op threads for the forward pass (default: torch's, "
                             "one per core); on a busy or small host, 1 avoids oversubscription")
    engine.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                        help="weight matmuls: onednn packs weights once (2-3x faster on CPU), "
                             "torch uses F.linear, auto picks oneDNN where this CPU supports it")
    engine.add_argument("--ops-backend", default="auto", choices=OPS_BACKENDS,
                        help="attention and element-wise ops: kernels are compiled C (built on "
                             "first use with the machine's C compiler; float32; attention reads "
                             "KV blocks in place), torch uses torch ops and gathers KV blocks "
                             "for SDPA, auto uses the kernels where they build")
    server = parser.add_argument_group("server")
    server.add_argument("--max-body-bytes", type=_size_in_bytes, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (larger ones get 413)")
    server.add_argument("--drain-timeout", type=_non_negative, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests")
    server.add_argument("--admin-token", default=None,
                        help="bearer token for /admin/* (default: $INFEROPS_ADMIN_TOKEN, "
                             "which keeps it out of `ps`; without one the admin API is off)")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="log level")
    for key, default in DEFAULT_BUCKETS.items():
        server.add_argument(f"--histogram-buckets-{key}", type=_buckets, default=None,
                            metavar="S1,S2,...",
                            help=f"{key} histogram bucket edges in seconds "
                                 f"(default: vLLM's, {default[0]}..{default[-1]})")
    faults = parser.add_argument_group("fault injection (tests and game days; off by default)")
    faults.add_argument("--fault-ttft-ms", type=_non_negative, default=0.0,
                        help="extra delay before each request's first token")
    faults.add_argument("--fault-tpot-ms", type=_non_negative, default=0.0,
                        help="extra delay per output token after the first")
    faults.add_argument("--fault-error-rate", type=_fraction, default=0.0,
                        help="fraction of requests answered with a 500")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    model_root = str(Path(args.model).resolve())
    return ServerSettings(
        served_model_name=args.served_model_name or Path(model_root).name,
        model_root=model_root,
        max_body_bytes=args.max_body_bytes,
        admin_token=args.admin_token or os.environ.get("INFEROPS_ADMIN_TOKEN") or None,
        faults=FaultSettings(args.fault_ttft_ms, args.fault_tpot_ms, args.fault_error_rate),
        histogram_buckets={key: getattr(args, f"histogram_buckets_{key}")
                           for key in DEFAULT_BUCKETS
                           if getattr(args, f"histogram_buckets_{key}") is not None},
        generation_defaults=GenerationDefaults() if args.no_generation_config
        else GenerationDefaults.from_dir(model_root),
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Path(args.model, "config.json").is_file():
        logger.error("no config.json in %s", args.model)
        return 2
    try:
        settings = settings_from_args(args)
    except ValueError as error:  # an unusable generation_config.json
        logger.error("%s; fix it or start with --no-generation-config", error)
        return 2
    defaults = settings.generation_defaults
    if replace(defaults, ignored=()) != GenerationDefaults():  # any value applies
        logger.info("requests that leave them out get the checkpoint's generation_config.json "
                    "defaults: temperature=%s top_p=%s top_k=%s min_p=%s repetition_penalty=%s "
                    "(--no-generation-config: OpenAI's)", defaults.temperature, defaults.top_p,
                    defaults.top_k, defaults.min_p, defaults.repetition_penalty)
    if defaults.ignored:
        logger.warning("generation_config.json sets %s, which this runtime does not apply",
                       ", ".join(defaults.ignored))
    replica = ReplicaServer(build_backend(args), settings)
    config = uvicorn.Config(replica.build_app(), host=args.host, port=args.port,
                            log_level=args.log_level, lifespan="on",
                            # Our own drain waited already; what is left after it is cut.
                            timeout_graceful_shutdown=1, timeout_keep_alive=5)
    server = DrainingServer(config, replica, args.drain_timeout)
    logger.info("serving %s as %r on http://%s:%d (loading in the background)",
                settings.model_root, settings.served_model_name, args.host, args.port)
    server.run()
    return server.exit_code
