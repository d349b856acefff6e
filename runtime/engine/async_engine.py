"""Bridges the synchronous engine to asyncio.

The model runs in its own thread, so a long forward pass never stalls the event loop that
streams tokens. The thread loads the model (the server answers /health 503 meanwhile), then
steps while there is work and sleeps on a condition otherwise. Commands from the event loop
(add, abort) are queued under the condition and applied between steps, so the engine is only
ever touched from its own thread. Outputs go back to per-request asyncio.Queues through
`loop.call_soon_threadsafe`, once per step.

`AsyncEngine` serves generative checkpoints; `AsyncEmbedder` serves encoder checkpoints and
batches concurrent embedding requests into one forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

LOADING, READY, FAILED, DEAD, STOPPED = "loading", "ready", "failed", "dead", "stopped"


class EngineUnavailableError(RuntimeError):
    """The model is still loading, failed to load, or its loop thread has died."""

    def __init__(self, state: str, detail: str = "") -> None:
        self.state = state
        reason = {LOADING: "The model is still loading.",
                  FAILED: "The model failed to load.",
                  DEAD: "The engine loop has stopped.",
                  STOPPED: "The server is shutting down."}.get(state, "Engine unavailable.")
        super().__init__(f"{reason} {detail}".strip())


@dataclass(frozen=True)
class EngineEvent:
    """One CompletionOutput plus when the engine step that produced it began."""

    output: Any
    step_started_at: float


class _ModelThread:
    """Loads a model in a daemon thread and runs `_serve()` there; tracks the lifecycle."""

    thread_name = "model-loop"

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self.model: Any = None
        self.state = LOADING
        self.error = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == READY

    def check_ready(self) -> None:
        if self.state != READY:
            raise EngineUnavailableError(self.state, self.error)

    def stop(self, timeout: float = 5.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.model = self._load()
        except BaseException as exc:  # a load failure must surface on /health, not vanish
            logger.exception("model failed to load")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = FAILED
            return
        self.state = READY
        logger.info("model loaded; serving")
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("model loop died")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = DEAD
            self._call_soon(self._fail_all)
            return
        self.state = STOPPED
        self._call_soon(self._fail_all)

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def _serve(self) -> None:
        raise NotImplementedError

    def _fail_all(self) -> None:
        raise NotImplementedError


class _RequestChannel:
    """Where the loop thread's news for one request lands on the event loop."""

    def __init__(self, num_choices: int, accepted: asyncio.Future[None]) -> None:
        self.accepted = accepted  # resolved once the engine took (or refused) the request
        self.queue: asyncio.Queue[EngineEvent | BaseException] = asyncio.Queue()
        self.num_choices = num_choices
        self.finished_choices: set[int] = set()
        # Set to end the request ahead of outputs still queued (e.g. a drain timed out).
        self.interrupt: BaseException | None = None


class RequestStream:
    """The outputs of one accepted request, until all of its `n` choices finish.

    Leaving early (the consumer stops iterating, is cancelled, or calls `close()`) aborts the
    request at once, which frees its KV blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, channel: _RequestChannel) -> None:
        self.engine = engine
        self.request_id = request_id
        self.channel = channel
        self.done = False

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[EngineEvent]:
        channel = self.channel
        try:
            while not self.done:
                item = channel.interrupt or await channel.queue.get()
                if isinstance(item, BaseException):
                    self.done = True  # the engine is gone; nothing left to abort
                    raise item
                if item.output.finished:
                    channel.finished_choices.add(item.output.index)
                    self.done = len(channel.finished_choices) >= channel.num_choices
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        self.engine._forget(self.request_id, abort=not self.done)
        self.done = True


class AsyncEngine(_ModelThread):
    """Runs an LLMEngine in a thread and streams its outputs to coroutines."""

    def __init__(self, load: Callable[[], Any]) -> None:
        super().__init__(load)
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._channels: dict[str, _RequestChannel] = {}  # touched on the event loop only

    @property
    def max_model_len(self) -> int:
        self.check_ready()
        return int(self.model.max_model_len)

    @property
    def tokenizer(self) -> Any:
        self.check_ready()
        return self.model.tokenizer

    def stats(self) -> Any | None:
        return self.model.stats() if self.model is not None else None

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: Any,
                     priority: int = 0) -> RequestStream:
        """Hand a request to the engine; returns once the engine has accepted it.

        Raises the engine's ValueError when it refuses the request, and
        EngineUnavailableError when the model is not serving.
        """
        if request_id in self._channels:
            raise ValueError(f"duplicate request id {request_id}")
        assert self._loop is not None
        channel = _RequestChannel(max(1, int(getattr(params, "n", 1) or 1)),
                                  self._loop.create_future())
        self._channels[request_id] = channel
        # Checked after registering: a loop that dies from here on fails this channel too.
        if self.state != READY:
            del self._channels[request_id]
            raise EngineUnavailableError(self.state, self.error)
        self._submit("add", request_id, list(prompt_token_ids), params, priority)
        try:
            await channel.accepted
        except BaseException:
            self._forget(request_id, abort=True)
            raise
        return RequestStream(self, request_id, channel)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any,
                       priority: int = 0) -> AsyncIterator[EngineEvent]:
        """`submit()` and iterate in one call."""
        stream = await self.submit(request_id, prompt_token_ids, params, priority)
        async for event in stream:
            yield event

    def interrupt_all(self, error: BaseException) -> int:
        """End every request in flight with `error` and abort it; returns how many."""
        channels = list(self._channels.items())
        for request_id, channel in channels:
            channel.interrupt = error
            channel.queue.put_nowait(error)  # wakes a consumer waiting for output
            _settle(channel.accepted, None, error)
            self._forget(request_id, abort=True)
        return len(channels)

    def _forget(self, request_id: str, abort: bool) -> None:
        if self._channels.pop(request_id, None) is not None and abort:
            self._submit("abort", request_id)

    def _submit(self, command: str, *args: Any) -> None:
        with self._wakeup:
            self._pending.append((command, args))
            self._wakeup.notify()

    def _serve(self) -> None:
        engine = self.model
        while True:
            with self._wakeup:
                while not (self._pending or self._stopping or engine.has_unfinished_requests()):
                    self._wakeup.wait()
                if self._stopping:
                    return
                commands, self._pending = self._pending, []
            for command, args in commands:
                self._apply(engine, command, args)
            if not engine.has_unfinished_requests():
                continue
            step_started_at = time.monotonic()
            outputs = engine.step()
            if outputs:
                self._call_soon(self._dispatch, outputs, step_started_at)

    def _apply(self, engine: Any, command: str, args: tuple[Any, ...]) -> None:
        if command == "abort":
            engine.abort_request(args[0])
            return
        request_id, prompt_token_ids, params, priority = args
        try:
            engine.add_request(request_id, prompt_token_ids, params, priority=priority)
        except (ValueError, TypeError) as exc:  # the request is bad, the engine is fine
            self._call_soon(self._settle_acceptance, request_id, exc)
        else:
            self._call_soon(self._settle_acceptance, request_id, None)

    def _settle_acceptance(self, request_id: str, exc: BaseException | None) -> None:
        channel = self._channels.get(request_id)
        if channel is not None:
            _settle(channel.accepted, None, exc)

    def _dispatch(self, outputs: list[Any], step_started_at: float) -> None:
        for output in outputs:
            # A request aborted a moment ago may still appear in one more step's outputs.
            channel = self._channels.get(output.request_id)
            if channel is not None:
                channel.queue.put_nowait(EngineEvent(output, step_started_at))

    def _fail_all(self) -> None:
        for channel in self._channels.values():
            error = EngineUnavailableError(self.state, self.error)
            _settle(channel.accepted, None, error)
            channel.queue.put_nowait(error)


@dataclass
class EncoderStats:
    """The subset of engine stats an encoder has, under the same attribute names."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class AsyncEmbedder(_ModelThread):
    """Runs an EmbeddingModel in a thread; concurrent requests share one batch."""

    thread_name = "embedding-loop"

    def __init__(self, load: Callable[[], Any], max_batch_inputs: int = 64) -> None:
        super().__init__(load)
        self.max_batch_inputs = max_batch_inputs
        self._pending: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._running_batch: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._stats = EncoderStats()

    def stats(self) -> EncoderStats:
        return self._stats

    async def embed(self, inputs: list[Any]) -> tuple[list[list[float]], list[int]]:
        self.check_ready()
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        with self._wakeup:
            self._pending.append((inputs, future))
            self._stats.num_waiting += 1
            self._wakeup.notify()
        return await future

    def _take_batch(self) -> list[tuple[list[Any], asyncio.Future[Any]]]:
        batch, size = [], 0
        while self._pending and (not batch or size + len(self._pending[0][0])
                                 <= self.max_batch_inputs):
            item = self._pending.pop(0)
            batch.append(item)
            size += len(item[0])
        return batch

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not (self._pending or self._stopping):
                    self._wakeup.wait()
                if self._stopping:
                    return
                batch = self._take_batch()
                self._stats.num_waiting -= len(batch)
                self._stats.num_running = len(batch)
                self._running_batch = batch
            self._run_batch(batch)
            self._running_batch = []
            self._stats.num_running = 0

    def _run_batch(self, batch: list[tuple[list[Any], asyncio.Future[Any]]]) -> None:
        # Texts and token-id inputs cannot share one call, so group by kind.
        for want_text in (True, False):
            group = [(inputs, fut) for inputs, fut in batch
                     if isinstance(inputs[0], str) == want_text]
            if not group:
                continue
            flat = [x for inputs, _ in group for x in inputs]
            try:
                vectors, counts = self.model.embed(flat)
            except (ValueError, TypeError) as exc:
                if len(group) > 1:  # one bad request must not fail its batch neighbours
                    for item in group:
                        self._run_batch([item])
                    continue
                self._call_soon(_settle, group[0][1], None, exc)
                continue
            self._stats.prompt_tokens_total += sum(counts)
            start = 0
            for inputs, fut in group:
                end = start + len(inputs)
                self._call_soon(_settle, fut, (vectors[start:end], counts[start:end]), None)
                start = end

    def _fail_all(self) -> None:
        with self._wakeup:
            pending, self._pending = self._running_batch + self._pending, []
        for _, fut in pending:
            _settle(fut, None, EngineUnavailableError(self.state, self.error))


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
