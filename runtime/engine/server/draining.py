"""Draining: which requests are admitted, how many are in flight, and what SIGTERM does.

The first SIGTERM/SIGINT turns /health and new model requests to 503 and waits for the
requests in flight (up to --drain-timeout); what is still running then is ended with an error
event rather than a cut connection. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.engine.async_engine import FAILED, LOADING, STOPPED, AsyncEngine, EngineUnavailableError
from runtime.engine.openai_protocol import OpenAIError
from runtime.engine.server.responses import error_response

if TYPE_CHECKING:
    from runtime.engine.server.routes import ReplicaServer

logger = logging.getLogger("inferops.serve")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})


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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
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
