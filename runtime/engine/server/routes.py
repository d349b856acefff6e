"""The HTTP endpoints of one replica: parse, check, hand a generation to `GenerationRun`,
answer. Every failure is an OpenAI-style error body; nothing here touches the engine's
thread directly.

A whole (non-streamed) answer carries `Server-Timing: ttft;dur=<ms>, tpot;dur=<ms>` (TPOT only
with two or more tokens), since a proxy cannot see its first token; a stream's headers leave
before its first token, and its client times the chunks itself."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.engine.async_engine import (
    READY,
    AsyncEmbedder,
    AsyncEngine,
    EngineRequest,
    EngineUnavailableError,
    RequestRefused,
)
from runtime.engine.config import GenerationDefaults
from runtime.engine.metrics import RequestTimer, ServerMetrics
from runtime.engine.openai_protocol import (
    GenerationRequest,
    OpenAIError,
    ResponseShapes,
    bad_request,
    embedding_response,
    new_request_id,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    parse_tokenize_request,
    usage_body,
)
from runtime.engine.server.draining import AdmissionMiddleware, Lifecycle
from runtime.engine.server.generation import (
    LONG_PROMPT_CHARS,
    GenerationRun,
    chat_token_ids,
    checked_max_tokens,
    tokenize_prompt,
)
from runtime.engine.server.responses import SSE_HEADERS, error_response, unavailable_error
from runtime.engine.server.settings import ServerSettings, target_ms
from runtime.engine.slo_scheduling import SloTargets
from runtime.gateway import jsonbody, jsonlog
from runtime.gateway.contract import SLO_TPOT_HEADER, SLO_TTFT_HEADER

logger = logging.getLogger("inferops.serve")

T = TypeVar("T")


async def read_json_body(request: Request, limit: int) -> Any:
    """Reads the body, refusing it as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = OpenAIError(413, f"The request body exceeds the limit of {limit} bytes.", "body")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # a missing or lying Content-Length must not get past the limit
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the read deadline: no one to answer, nothing to log
        raise OpenAIError(499, "The client went away before its request body arrived.") from None
    try:
        return jsonbody.loads(b"".join(chunks))
    except jsonbody.MalformedBody as exc:
        raise bad_request(f"Malformed JSON body: {exc}", "body") from None


def log_request_id(request: Request) -> None:
    """The gateway's X-Request-Id on this request's log lines, so they match the gateway's."""
    jsonlog.REQUEST_ID.set(request.headers.get("x-request-id", "")[:128] or None)


def server_timing(timer: RequestTimer) -> str | None:
    """TTFT from arrival and TPOT between the first and last token, in ms, as vLLM defines them."""
    if timer.first_token_at is None:
        return None
    timing = f"ttft;dur={(timer.first_token_at - timer.arrived_at) * 1000:.3f}"
    if timer.num_output_tokens > 1 and timer.last_token_at is not None:
        tpot = (timer.last_token_at - timer.first_token_at) / (timer.num_output_tokens - 1)
        timing += f", tpot;dur={tpot * 1000:.3f}"
    return timing


class ClientDisconnected(Exception):
    pass


async def with_first_chunk(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Waits for the first chunk (raising what the stream raises before it), then streams it and
    the rest."""
    first = await anext(chunks)

    async def rest() -> AsyncIterator[str]:
        yield first
        async for chunk in chunks:
            yield chunk
    return rest()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
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


class ReplicaServer:
    """The HTTP endpoints of one replica serving one model."""

    def __init__(self, backend: AsyncEngine | AsyncEmbedder, settings: ServerSettings,
                 gpu_collector: Collector | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.faults = settings.faults
        self.lifecycle = Lifecycle()
        self.metrics = ServerMetrics(settings.served_model_name, backend.stats,
                                     settings.histogram_buckets, settings, loaded_at=lambda: backend.loaded_at,
                                     gpu_collector=gpu_collector)
        self.started_at = int(time.time())

    def build_app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/admin/faults", self.admin_faults, methods=["GET", "POST"]),
            Route("/admin/slo-targets", self.admin_slo_targets, methods=["GET", "POST"]),
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
        # In a thread: a scrape reads NVML (seven driver calls a GPU), which must never hold up
        # the event loop that streams tokens.
        return Response(await asyncio.to_thread(self.metrics.render),
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

    async def admin_slo_targets(self, request: Request) -> Response:
        """The replica-wide TTFT and TPOT targets, which the control plane sets from the
        deployment's latency SLOs; they apply to requests that arrive from then on."""
        self._authorize_admin(request)
        targets = self.settings.slo_targets
        if request.method == "POST":
            before = targets.as_json()
            targets.update(await read_json_body(request, self.settings.max_body_bytes))
            if targets.as_json() != before:  # the control plane re-sends them every tick
                logger.info("SLO targets set: %s", targets.as_json())
        return JSONResponse(targets.as_json())

    def _request_targets(self, request: Request) -> SloTargets:
        """Header (the gateway's, from the tenant's SLO) > the control plane's > the engine's."""
        asked = {}
        for name, header in (("ttft_ms", SLO_TTFT_HEADER), ("tpot_ms", SLO_TPOT_HEADER)):
            text = request.headers.get(header)
            if text is None:
                continue
            try:
                asked[name] = target_ms(float(text), header)
            except ValueError:
                raise bad_request(f"`{header}` must be a number of milliseconds, got {text[:40]!r}.",
                                  header) from None
        return SloTargets.from_ms(asked.get("ttft_ms"), asked.get("tpot_ms")).or_else(
            self.settings.slo_targets.effective)

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
        log_request_id(request)
        body = await read_json_body(request, self.settings.max_body_bytes)
        parsed = parse_embedding_request(body)
        self._check_model(parsed.model)
        if not isinstance(self.backend, AsyncEmbedder):
            raise bad_request("This model does not support the Embeddings API.", "model")
        self._check_ready()
        self._maybe_inject_error()
        try:
            result = await self.backend.embed(parsed.inputs)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), "input") from None
        except EngineUnavailableError as exc:
            raise unavailable_error(exc) from None
        self.metrics.on_output()
        return JSONResponse(embedding_response(self.settings.served_model_name, result.vectors,
                                               result.token_counts, parsed.encoding_format))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the token ids the model would see for a prompt or chat, so a
        client (an eval harness) can split a text into context and continuation tokens."""
        log_request_id(request)
        body = await read_json_body(request, self.settings.max_body_bytes)
        parsed = parse_tokenize_request(body)
        self._check_model(parsed.model)
        engine = self.backend
        if not isinstance(engine, AsyncEngine):
            raise bad_request("This model only supports the Embeddings API.", "model")
        self._check_ready()
        tokenizer = engine.tokenizer

        def token_ids() -> list[int]:
            if parsed.messages is not None:
                return chat_token_ids(tokenizer, parsed.messages, parsed.add_generation_prompt,
                                      parsed.add_special_tokens)
            return tokenizer.encode(parsed.prompt or "", parsed.add_special_tokens)

        text_size = len(parsed.prompt or "") + sum(len(m["content"])
                                                   for m in parsed.messages or [])
        if text_size > LONG_PROMPT_CHARS:  # off the event loop, as generation does
            tokens = await asyncio.to_thread(token_ids)
        else:
            tokens = token_ids()
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len,
                                  "tokens": tokens, "token_strs": None}
        if parsed.return_token_strs:  # the vocabulary's own spelling, as vLLM gives them
            answer["token_strs"] = [tokenizer.backend.id_to_token(t) for t in tokens]
        return JSONResponse(answer)

    async def _generate(self, request: Request,
                        parse: Callable[[Any, GenerationDefaults], GenerationRequest]
                        ) -> Response:
        timer = self.metrics.start_request()  # TTFT and E2E count from arrival
        log_request_id(request)
        timer.targets = targets = self._request_targets(request)
        body = await read_json_body(request, self.settings.max_body_bytes)
        parsed = parse(body, self.settings.generation_defaults)
        self._check_model(parsed.model)
        engine = self.backend
        if not isinstance(engine, AsyncEngine):
            raise bad_request("This model only supports the Embeddings API.", "model")
        self._check_ready()
        self._maybe_inject_error()
        prompt_ids = await tokenize_prompt(engine, parsed)
        max_tokens = checked_max_tokens(engine, parsed, len(prompt_ids))
        try:
            params = parsed.sampling_params(max_tokens)
        except ValueError as exc:  # SamplingParams' own checks, should ours ever miss one
            raise bad_request(str(exc)) from None
        request_id = new_request_id(parsed.kind)
        shapes = ResponseShapes(parsed.kind, request_id, self.settings.served_model_name,
                                engine.tokenizer.token_text)
        echo = None
        if parsed.echo:  # the prompt as sent, or as its token ids read
            echo = parsed.prompt_text if parsed.prompt_text is not None \
                else engine.tokenizer.decode(prompt_ids)
        run = GenerationRun(engine, self.faults, timer,
                            EngineRequest(request_id, prompt_ids, params, parsed.priority,
                                          timer.arrived_at, targets),
                            echo, parsed.echo_only)
        headers = {"X-Request-Id": request_id}
        try:
            if parsed.stream:
                # Submitted before the headers go out, so a refusal is still a plain 400; under
                # --slo-reject-late they wait for the first token, so a late refusal is a 503.
                await run.start()
                chunks = run.stream(shapes, parsed.include_usage)
                if self.settings.slo_reject_late:
                    chunks = await cancel_on_disconnect(request, with_first_chunk(chunks))
                return StreamingResponse(chunks,
                                         media_type="text/event-stream",
                                         headers={**SSE_HEADERS, **headers},
                                         # runs even when a disconnect cut the stream short
                                         background=BackgroundTask(run.close))
            choices = await cancel_on_disconnect(request, run.collect())
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        except EngineUnavailableError as exc:
            raise unavailable_error(exc) from None
        except RequestRefused as exc:  # the engine's reason, naming the field when it can
            raise bad_request(str(exc), exc.param) from None
        choices = [run.as_sent(c) for c in choices]
        usage = usage_body(len(prompt_ids), sum(c.num_output_tokens for c in choices))
        timing = server_timing(timer)
        if timing:
            headers["Server-Timing"] = timing
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
