"""One generation request's run through the engine: its prompt's token ids and room in the
context, then the engine's events with faults and metrics applied, streamed as SSE or
collected into whole choices."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from runtime.engine.async_engine import (
    STOPPED,
    AsyncEngine,
    EngineEvent,
    EngineRequest,
    EngineUnavailableError,
    RequestStream,
)
from runtime.engine.metrics import RequestTimer
from runtime.engine.openai_protocol import (
    ChoiceResult,
    GenerationRequest,
    OpenAIError,
    ResponseShapes,
    bad_request,
    usage_body,
)
from runtime.engine.server.responses import SSE_DONE, sse, unavailable_error
from runtime.engine.server.settings import FaultSettings
from runtime.gateway.contract import SLO_LATE

if TYPE_CHECKING:  # sampling.py imports torch, which loads in the model thread
    from runtime.engine.sampling import TokenLogprob
    from runtime.engine.tokenizer import Tokenizer

logger = logging.getLogger("inferops.serve")

LONG_PROMPT_CHARS = 32 * 1024

# The engine failed one request (finish_reason "error") and goes on serving the others.
NON_FINITE_LOGITS = (
    "The model's logits for this request were NaN or infinite, so no token could be chosen. "
    "The checkpoint's weights may be broken, or its numbers overflow in this dtype: try "
    "serving it with --dtype float32.")


def late_refusal(retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        503, "The server is overloaded: this request could no longer meet its time-to-first-token target, "
             f"so it was refused rather than served late. Retry after {retry_after_s} s, or elsewhere.",
        code=SLO_LATE, headers={"Retry-After": str(retry_after_s)})


async def tokenize_prompt(engine: AsyncEngine, parsed: GenerationRequest) -> list[int]:
    """Token ids of the prompt; long prompts are tokenized off the event loop so they do
    not stall every other stream (this helps as far as the tokenizer releases the GIL)."""
    text_size = len(parsed.prompt_text or "") + sum(
        len(m["content"]) for m in parsed.messages or [])
    if text_size > LONG_PROMPT_CHARS:
        return await asyncio.to_thread(prompt_token_ids, engine, parsed)
    return prompt_token_ids(engine, parsed)


def prompt_token_ids(engine: AsyncEngine, parsed: GenerationRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if parsed.prompt_token_ids is not None:
        return parsed.prompt_token_ids
    if parsed.prompt_text is not None:
        return list(tokenizer.encode(parsed.prompt_text, add_special_tokens=True))
    return chat_token_ids(tokenizer, parsed.messages or [])


def chat_token_ids(tokenizer: Tokenizer, messages: list[dict[str, str]],
                   add_generation_prompt: bool = True,
                   add_special_tokens: bool = False) -> list[int]:
    """The messages through the chat template, as token ids (for generation and /tokenize)."""
    # OpenAI's "developer" role is the newer name for "system"; templates know the latter.
    messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                for m in messages]
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja2 raise_exception and template errors are input errors
        raise bad_request(f"The chat template rejected the messages: {exc}",
                          "messages") from None
    # The template writes the special tokens (BOS) itself, unless asked for them again.
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def checked_max_tokens(engine: AsyncEngine, parsed: GenerationRequest,
                       num_prompt_tokens: int) -> int:
    """The tokens to sample: what the request asked for, or (chat) all the context leaves."""
    max_model_len = engine.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request("The prompt is empty.", "prompt")
    if parsed.max_tokens is None:  # chat default: whatever room the context leaves
        if num_prompt_tokens >= max_model_len:
            raise _too_long(max_model_len, num_prompt_tokens, 1, "messages")
        return max_model_len - num_prompt_tokens
    # Echoing the prompt alone still samples one token, which is not sent.
    max_tokens = max(parsed.max_tokens, 1)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise _too_long(max_model_len, num_prompt_tokens, max_tokens, "max_tokens")
    return max_tokens


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

    def __init__(self, engine: AsyncEngine, faults: FaultSettings, timer: RequestTimer,
                 request: EngineRequest, echo: str | None = None,
                 echo_only: bool = False) -> None:
        self.engine = engine
        self.faults = faults
        self.timer = timer
        timer.num_prompt_tokens = len(request.prompt_token_ids)
        self.request = request
        self.echo = echo
        self.echo_only = echo_only
        self.prompt_logprobs: list[TokenLogprob] | None = None  # from the first output
        self.choices = [ChoiceResult(index=i) for i in range(request.params.n)]
        self.engine_stream: RequestStream | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

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
        try:
            self.engine_stream = await self.engine.submit(self.request)
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
        faults = self.faults
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
                if output.finish_reason == "late":
                    outcome = "late"
                    raise late_refusal(output.retry_after_s or 1)
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
                            self.prompt_logprobs if self.request.params.logprobs is not None
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
            if isinstance(exc, OpenAIError) and exc.code == SLO_LATE and not opened:
                raise  # before the first chunk: the headers wait for it (--slo-reject-late)
            # Headers are gone already; vLLM reports mid-stream failures as an error event.
            error = unavailable_error(exc) if isinstance(exc, EngineUnavailableError) else exc
            yield sse(error.body())
            yield SSE_DONE
            return
        except Exception:  # a bug: log it, but still end the stream the way clients expect
            logger.exception("stream %s failed", self.request_id)
            yield sse(OpenAIError(500, "Internal server error.").body())
            yield SSE_DONE
            return
        if include_usage:
            completion_tokens = sum(self.as_sent(c).num_output_tokens for c in self.choices)
            yield sse(shapes.stream_usage_chunk(usage_body(len(self.request.prompt_token_ids),
                                                           completion_tokens)))
        yield SSE_DONE
