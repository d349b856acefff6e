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
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, Protocol, TypeVar

from runtime.engine.slo_scheduling import SloTargets

if TYPE_CHECKING:  # each of these imports torch, which loads in the model thread
    from runtime.engine.engine import CompletionOutput, EngineStats
    from runtime.engine.sampling import SamplingParams
    from runtime.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EngineState = Literal["loading", "ready", "failed", "dead", "stopped"]
LOADING: Final = "loading"
READY: Final = "ready"
FAILED: Final = "failed"
DEAD: Final = "dead"
STOPPED: Final = "stopped"


class EngineUnavailableError(RuntimeError):
    """The model is still loading, failed to load, or its loop thread has died."""

    def __init__(self, state: EngineState, detail: str = "") -> None:
        self.state: EngineState = state
        self.detail = detail
        reason = {LOADING: "The model is still loading.",
                  FAILED: "The model failed to load.",
                  DEAD: "The engine loop has stopped.",
                  STOPPED: "The server is shutting down."}.get(state, "Engine unavailable.")
        super().__init__(f"{reason} {detail}".strip())


class RequestRefused(ValueError):
    """The engine would not take a request (too long, a bad token id, ...); the engine itself
    is fine. `param` names the request field at fault when the engine said which."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GenerativeModel(Protocol):
    """What the bridge drives: LLMEngine's API, called from the model thread only."""

    tokenizer: Tokenizer
    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    targets: SloTargets | None = None) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[CompletionOutput]: ...
    def stats(self) -> EngineStats: ...


EmbeddingInputs = list[str] | list[list[int]]


class EmbeddingModelLike(Protocol):
    """What the embedder drives: EmbeddingModel's API."""

    def embed(self, inputs: EmbeddingInputs) -> tuple[list[list[float]], list[int]]: ...


@dataclass(frozen=True)
class EngineRequest:
    """A request handed to the engine: what `AsyncEngine.submit()` takes."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # time.monotonic() when the request arrived; TTFT counts from it
    targets: SloTargets | None = None

    @property
    def num_choices(self) -> int:
        return max(1, int(self.params.n or 1))


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class EngineEvent:
    """One sequence's output of one engine step, and when that step began."""

    output: CompletionOutput
    step_started_at: float


@dataclass(frozen=True)
class Embeddings:
    """One unit vector per input and the number of tokens each input used."""

    vectors: list[list[float]]
    token_counts: list[int]


ModelT = TypeVar("ModelT")


class _ModelThread(Generic[ModelT]):
    """Loads a model in a daemon thread and runs `_serve()` there; tracks the lifecycle."""

    thread_name = "model-loop"

    def __init__(self, load: Callable[[], ModelT]) -> None:
        self._load = load
        self.model: ModelT | None = None
        self.state: EngineState = LOADING
        self.error = ""
        # Unix time the load returned (weights in memory, ready to serve): a cold start's second phase.
        self.loaded_at: float | None = None
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
        self.loaded_at = time.time()
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


class AsyncEngine(_ModelThread[GenerativeModel]):
    """Runs an LLMEngine in a thread and streams its outputs to coroutines."""

    def __init__(self, load: Callable[[], GenerativeModel]) -> None:
        super().__init__(load)
        self._pending: list[EngineRequest | _Abort] = []
        self._channels: dict[str, _RequestChannel] = {}  # touched on the event loop only

    @property
    def engine(self) -> GenerativeModel:
        self.check_ready()
        assert self.model is not None
        return self.model

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> EngineStats | None:
        return self.model.stats() if self.model is not None else None

    async def submit(self, request: EngineRequest) -> RequestStream:
        """Hand a request to the engine; returns once the engine has accepted it.

        Raises RequestRefused when the engine refuses the request, and
        EngineUnavailableError when the model is not serving.
        """
        request_id = request.request_id
        if request_id in self._channels:
            raise RequestRefused(f"duplicate request id {request_id}")
        assert self._loop is not None
        channel = _RequestChannel(request.num_choices, self._loop.create_future())
        self._channels[request_id] = channel
        # Checked after registering: a loop that dies from here on fails this channel too.
        if self.state != READY:
            del self._channels[request_id]
            raise EngineUnavailableError(self.state, self.error)
        self._submit(request)
        try:
            await channel.accepted
        except BaseException:
            self._forget(request_id, abort=True)
            raise
        return RequestStream(self, request_id, channel)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        """`submit()` and iterate in one call."""
        stream = await self.submit(request)
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
            self._submit(_Abort(request_id))

    def _submit(self, command: EngineRequest | _Abort) -> None:
        with self._wakeup:
            self._pending.append(command)
            self._wakeup.notify()

    def _serve(self) -> None:
        engine = self.model
        assert engine is not None
        while True:
            with self._wakeup:
                while not (self._pending or self._stopping or engine.has_unfinished_requests()):
                    self._wakeup.wait()
                if self._stopping:
                    return
                commands, self._pending = self._pending, []
            for command in commands:
                self._apply(engine, command)
            if not engine.has_unfinished_requests():
                continue
            step_started_at = time.monotonic()
            outputs = engine.step()
            if outputs:
                self._call_soon(self._dispatch, outputs, step_started_at)

    def _apply(self, engine: GenerativeModel, command: EngineRequest | _Abort) -> None:
        if isinstance(command, _Abort):
            engine.abort_request(command.request_id)
            return
        refusal: Exception | None = None
        try:
            engine.add_request(command.request_id, list(command.prompt_token_ids),
                               command.params, priority=command.priority,
                               arrival_time=command.arrival_time, targets=command.targets)
        except ValueError as exc:  # the request is bad, the engine is fine
            refusal = RequestRefused(str(exc), getattr(exc, "param", None))
        except TypeError as exc:  # a malformed request object is the server's bug: a 500
            refusal = exc
        self._call_soon(self._settle_acceptance, command.request_id, refusal)

    def _settle_acceptance(self, request_id: str, refusal: Exception | None) -> None:
        channel = self._channels.get(request_id)
        if channel is not None:
            _settle(channel.accepted, None, refusal)

    def _dispatch(self, outputs: list[CompletionOutput], step_started_at: float) -> None:
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


@dataclass(frozen=True, eq=False)
class _EmbeddingJob:
    """One embedding request waiting for (or in) a batch."""

    inputs: EmbeddingInputs
    result: asyncio.Future[Embeddings]


class AsyncEmbedder(_ModelThread[EmbeddingModelLike]):
    """Runs an EmbeddingModel in a thread; concurrent requests share one batch."""

    thread_name = "embedding-loop"

    def __init__(self, load: Callable[[], EmbeddingModelLike], max_batch_inputs: int = 64) -> None:
        super().__init__(load)
        self.max_batch_inputs = max_batch_inputs
        self._pending: list[_EmbeddingJob] = []
        self._running_batch: list[_EmbeddingJob] = []
        self._stats = EncoderStats()

    def stats(self) -> EncoderStats:
        return self._stats

    async def embed(self, inputs: EmbeddingInputs) -> Embeddings:
        self.check_ready()
        assert self._loop is not None
        job = _EmbeddingJob(inputs, self._loop.create_future())
        with self._wakeup:
            self._pending.append(job)
            self._stats.num_waiting += 1
            self._wakeup.notify()
        return await job.result

    def _take_batch(self) -> list[_EmbeddingJob]:
        batch: list[_EmbeddingJob] = []
        size = 0
        while self._pending and (not batch or size + len(self._pending[0].inputs)
                                 <= self.max_batch_inputs):
            job = self._pending.pop(0)
            batch.append(job)
            size += len(job.inputs)
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

    def _run_batch(self, batch: list[_EmbeddingJob]) -> None:
        model = self.model
        assert model is not None
        # Texts and token-id inputs cannot share one call, so group by kind.
        for want_text in (True, False):
            group = [job for job in batch if isinstance(job.inputs[0], str) == want_text]
            if not group:
                continue
            flat: Any = [x for job in group for x in job.inputs]  # one kind, grouped above
            try:
                vectors, counts = model.embed(flat)
            except (ValueError, TypeError) as exc:
                if len(group) > 1:  # one bad request must not fail its batch neighbours
                    for job in group:
                        self._run_batch([job])
                    continue
                self._call_soon(_settle, group[0].result, None, exc)
                continue
            self._stats.prompt_tokens_total += sum(counts)
            start = 0
            for job in group:
                end = start + len(job.inputs)
                self._call_soon(_settle, job.result,
                                Embeddings(vectors[start:end], counts[start:end]), None)
                start = end

    def _fail_all(self) -> None:
        with self._wakeup:
            pending, self._pending = self._running_batch + self._pending, []
        for job in pending:
            _settle(job.result, None, EngineUnavailableError(self.state, self.error))


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
