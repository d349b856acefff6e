"""OpenAI-compatible request validation and response shapes for the replica server.

Parsing is strict on purpose: a parameter the engine cannot honour (tools, response_format,
best_of, ...) is refused with a 400 that names it, because silently ignoring it would hand
the caller something other than what they asked for. Parameters that change nothing about the
generated tokens (`user`, `metadata`, ...) are accepted and ignored.

Shapes follow the recorded vLLM responses in tests/fixtures/vllm-0.32-cpu/.
"""

from __future__ import annotations

import base64
import math
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.engine.config import (
    MAX_ADDITIVE_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    GenerationDefaults,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from runtime.engine.sampling import SamplingParams, TokenLogprob

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# Accepted for compatibility with clients that always send them; they do not change tokens.
IGNORED_PARAMS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})

SAMPLING_PARAMS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
    "stop_token_ids", "ignore_eos", "stream", "stream_options", "priority",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "logit_bias",
    "min_tokens",
})

# Parameters that are only harmless at their "off" value; anything else is refused.
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),  # a chat parameter; completions ask with `logprobs: k`
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}

MAX_N = 16
# What a logprob of -inf is written as: JSON has no infinities (vLLM's choice too).
LOGPROB_FLOOR = -9999.0
MAX_STOP_STRINGS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


class OpenAIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code  # default: the status, as vLLM sends it
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; k: each token's logprob and k alternatives
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # Completions: the prompt comes back before the completion (with its logprobs when
    # `logprobs` is set); with max_tokens 0, only the prompt (how eval harnesses score text).
    echo: bool = False

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        # Imported here: sampling.py pulls in torch, which the server must not wait for
        # before it binds its port (it loads in the model thread).
        from runtime.engine.sampling import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
        )


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[str] | list[list[int]]
    encoding_format: str


class _Fields:
    """Typed access to a JSON object's fields; every failure names the field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", "body")
        self.body = body

    def get(self, name: str, types: tuple[type, ...], default: Any = None,
            type_name: str = "") -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        # bool is an int subclass in Python, but JSON true is not a number.
        if isinstance(value, bool) and bool not in types:
            value_ok = False
        else:
            value_ok = isinstance(value, types)
        if not value_ok:
            expected = type_name or " or ".join(t.__name__ for t in types)
            raise bad_request(
                f"`{name}` must be {expected}, got {_json_type(value)}.", name)
        return value

    def integer(self, name: str, default: int | None, minimum: int | None = None,
                maximum: int | None = None) -> int | None:
        value = self.get(name, (int,), default, "an integer")
        if value is not None:
            _check_range(name, value, minimum, maximum)
        return value

    def number(self, name: str, default: float, minimum: float | None = None,
               maximum: float | None = None) -> float:
        try:
            value = float(self.get(name, (int, float), default, "a number"))
        except OverflowError:  # an integer beyond any float
            raise bad_request(f"`{name}` is out of range.", name) from None
        if not math.isfinite(value):  # 1e400 reads as infinity
            raise bad_request(f"`{name}` must be a finite number, got {value}.", name)
        _check_range(name, value, minimum, maximum)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return self.get(name, (bool,), default, "a boolean")

    def refuse_unsupported(self, allowed: frozenset[str]) -> None:
        for name, value in self.body.items():
            if name in allowed or name in IGNORED_PARAMS:
                continue
            if name in OFF_VALUES:
                if value in OFF_VALUES[name]:
                    continue
                raise bad_request(f"`{name}` is not supported by this server.", name)
            raise bad_request(f"Unrecognized request parameter `{name}`.", name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise bad_request(f"`{name}` must be >= {minimum}, got {value}.", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"`{name}` must be <= {maximum}, got {value}.", name)


def _positive(value: float, name: str) -> float:
    if value <= 0:
        raise bad_request(f"`{name}` must be > 0, got {value}.", name)
    return value


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))


def _sampling_fields(fields: _Fields, defaults: GenerationDefaults,
                     max_tokens_default: int | None,
                     max_tokens_name: str = "max_tokens",
                     max_tokens_minimum: int = 1) -> dict[str, Any]:
    stop = fields.get("stop", (str, list), [], "a string or an array of strings")
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) and s for s in stop):
        raise bad_request("`stop` must be a non-empty string or an array of them.", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"`stop` accepts at most {MAX_STOP_STRINGS} strings.", "stop")
    stop_token_ids = fields.get("stop_token_ids", (list,), [], "an array of token ids")
    if stop_token_ids and not _is_token_list(stop_token_ids):
        raise bad_request("`stop_token_ids` must be an array of token ids.", "stop_token_ids")
    stream = fields.boolean("stream", False)
    stream_options = fields.get("stream_options", (dict,), None, "an object")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise bad_request("`stream_options` can only be set when `stream` is true.",
                              "stream_options")
        unknown = set(stream_options) - {"include_usage"}
        if unknown:
            raise bad_request(f"Unrecognized stream option `{sorted(unknown)[0]}`.",
                              "stream_options")
        include_usage = stream_options.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise bad_request(f"`stream_options.include_usage` must be a boolean, got {_json_type(include_usage)}.",
                              "stream_options")
        include_usage = include_usage is True
    top_k = fields.integer("top_k", defaults.top_k, minimum=-1)
    max_tokens = fields.integer(max_tokens_name, max_tokens_default, minimum=max_tokens_minimum)
    min_tokens = fields.integer("min_tokens", 0, minimum=0, maximum=max_tokens)
    return dict(
        model=fields.get("model", (str,), None, "a string"),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(fields.get("logit_bias", (dict,), None, "an object")),
        temperature=fields.number("temperature", defaults.temperature, minimum=0.0),
        top_p=_positive(fields.number("top_p", defaults.top_p, maximum=1.0), "top_p"),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "disabled"
        min_p=fields.number("min_p", defaults.min_p, minimum=0.0, maximum=1.0),
        n=fields.integer("n", 1, minimum=1, maximum=MAX_N),
        # Each of the n choices samples with seed + index, in a signed 64-bit generator.
        seed=fields.integer("seed", None, minimum=-2**63, maximum=2**63 - 1 - MAX_N),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=fields.boolean("ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        priority=fields.integer("priority", 0),
        presence_penalty=fields.number("presence_penalty", 0.0, minimum=-MAX_ADDITIVE_PENALTY,
                                       maximum=MAX_ADDITIVE_PENALTY),
        frequency_penalty=fields.number("frequency_penalty", 0.0,
                                        minimum=-MAX_ADDITIVE_PENALTY,
                                        maximum=MAX_ADDITIVE_PENALTY),
        repetition_penalty=_positive(fields.number("repetition_penalty",
                                                   defaults.repetition_penalty),
                                     "repetition_penalty"),
    )


def _logit_bias(raw: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's `{"token id": bias}`: JSON keys are strings, so ids come as digit strings."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        # Not "²"; and an id of 19 digits is out of every vocabulary (and of int()'s digit limit).
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 19):
            raise bad_request(f"`logit_bias` keys must be token ids, got {key[:40]!r}.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"`logit_bias` values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}], got {value!r} for {key}.", "logit_bias")
        bias[int(key)] = float(value)
    return bias


def parse_completion_request(
    body: Any, defaults: GenerationDefaults = GenerationDefaults()
) -> GenerationRequest:
    fields = _Fields(body)
    fields.refuse_unsupported(SAMPLING_PARAMS | {"prompt", "echo"})
    prompt = body.get("prompt")
    # A batch of exactly one prompt is what some clients send for a single prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    prompt_text, prompt_token_ids = None, None
    if isinstance(prompt, str):
        prompt_text = prompt
    elif _is_token_list(prompt):
        prompt_token_ids = list(prompt)
    elif prompt is None:
        raise bad_request("`prompt` is required.", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise bad_request("Batched prompts are not supported; send one prompt per request.",
                          "prompt")
    else:
        raise bad_request("`prompt` must be a string or an array of token ids.", "prompt")
    echo = fields.boolean("echo", False)
    sampling = _sampling_fields(fields, defaults, max_tokens_default=16,
                                max_tokens_minimum=0 if echo else 1)
    return GenerationRequest(kind="completion", prompt_text=prompt_text,
                             prompt_token_ids=prompt_token_ids,
                             logprobs=fields.integer("logprobs", None, minimum=0,
                                                     maximum=MAX_LOGPROBS),
                             echo=echo, **sampling)


def parse_chat_request(
    body: Any, defaults: GenerationDefaults = GenerationDefaults()
) -> GenerationRequest:
    fields = _Fields(body)
    fields.refuse_unsupported(SAMPLING_PARAMS | {"messages", "max_completion_tokens",
                                                 "top_logprobs"})
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad_request("Set either `max_tokens` or `max_completion_tokens`, not both.",
                          "max_completion_tokens")
    max_tokens_name = "max_tokens" if body.get("max_tokens") is not None \
        else "max_completion_tokens"
    sampling = _sampling_fields(fields, defaults, max_tokens_default=None,
                                max_tokens_name=max_tokens_name)
    logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("`top_logprobs` needs `logprobs` set to true.", "top_logprobs")
    return GenerationRequest(kind="chat", messages=_parse_messages(body.get("messages")),
                             logprobs=(top_logprobs or 0) if logprobs else None, **sampling)


def _parse_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise bad_request("`messages` is required.", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty array.", "messages")
    parsed = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"`{param}` must be an object.", param)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a dict or list is unhashable: a 500
            raise bad_request(
                f"`{param}.role` must be one of {', '.join(sorted(CHAT_ROLES))}"
                f"{'; tool messages are not supported' if role == 'tool' else ''}.",
                f"{param}.role")
        if message.get("tool_calls"):
            raise bad_request("Tool calls are not supported by this server.",
                              f"{param}.tool_calls")
        if not isinstance(message.get("name"), (str, type(None))):
            raise bad_request(f"`{param}.name` must be a string.", f"{param}.name")
        unknown = set(message) - {"role", "content", "name", "tool_calls"}
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"Unrecognized message field `{name}`.", f"{param}.{name}")
        parsed.append({"role": role, "content": _message_text(message.get("content"), param)})
    return parsed


def _message_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request("Only text content parts are supported.",
                                  f"{param}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"`{param}.content` must be a string or an array of text parts.",
                      f"{param}.content")


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    fields = _Fields(body)
    fields.refuse_unsupported(frozenset({"model", "input", "encoding_format"}))
    if body.get("dimensions") is not None:
        raise bad_request("`dimensions` is not supported by this server.", "dimensions")
    raw = body.get("input")
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif _is_token_list(raw):
        inputs = [list(raw)]
    elif isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                            or all(_is_token_list(x) for x in raw)):
        inputs = list(raw)
    elif raw is None:
        raise bad_request("`input` is required.", "input")
    else:
        raise bad_request("`input` must be a string, an array of strings, or token ids.",
                          "input")
    if any(isinstance(x, str) and not x for x in inputs):
        raise bad_request("`input` must not contain empty strings.", "input")
    encoding_format = fields.get("encoding_format", (str,), "float", "a string")
    if encoding_format not in ("float", "base64"):
        raise bad_request("`encoding_format` must be `float` or `base64`.", "encoding_format")
    return EmbeddingRequest(model=fields.get("model", (str,), None, "a string"),
                            inputs=inputs, encoding_format=encoding_format)


@dataclass(frozen=True)
class TokenizeRequest:
    """One /tokenize request, in vLLM's two shapes: a `prompt`, or chat `messages`."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    fields = _Fields(body)
    chat = body.get("messages") is not None
    allowed = {"model", "add_special_tokens", "return_token_strs"}
    fields.refuse_unsupported(frozenset(allowed | ({"messages", "add_generation_prompt"}
                                                   if chat else {"prompt"})))
    prompt = None
    if not chat:
        prompt = fields.get("prompt", (str,), None, "a string")
        if prompt is None:
            raise bad_request("`prompt` or `messages` is required.", "prompt")
    # vLLM's defaults: a prompt gets the special tokens, a chat's template writes its own.
    return TokenizeRequest(
        model=fields.get("model", (str,), None, "a string"),
        prompt=prompt,
        messages=_parse_messages(body["messages"]) if chat else None,
        add_special_tokens=fields.boolean("add_special_tokens", not chat),
        add_generation_prompt=fields.boolean("add_generation_prompt", True),
        return_token_strs=fields.boolean("return_token_strs", False))


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{secrets.token_hex(8)}"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class ResponseShapes:
    """Builds the JSON bodies for one generation request, streamed or not.

    `token_text` names a token id in logprobs (the token decoded on its own, as vLLM does)."""

    def __init__(self, kind: str, request_id: str, model: str,
                 token_text: Callable[[int], str] = str) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self._text_offsets: dict[int, int] = {}  # per choice: where its next token starts

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """A choice's `logprobs` for these tokens: OpenAI's chat shape (`content`) or its
        legacy completions shape (parallel lists, `text_offset` counted over the choice)."""
        if entries is None:
            return None
        if self.kind == "chat":
            return {"content": [{**self._chat_logprob(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_logprob(token_id, logprob)
                                                  for token_id, logprob in e.top]}
                                for e in entries]}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets, offset = [], self._text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        top: list[dict[str, float] | None] = []
        for token, e in zip(tokens, entries, strict=True):
            if e.logprob is None:  # a prompt's first token: nothing predicted it
                top.append(None)
                continue
            alternatives = {self.token_text(i): _json_logprob(lp) for i, lp in e.top}
            # The sampled token too, as vLLM lists it; its own logprob wins over another
            # token's that reads the same (two byte tokens both shown as U+FFFD, say).
            alternatives[token] = _json_logprob(e.logprob)
            top.append(alternatives)
        return {"text_offset": offsets,
                "token_logprobs": [None if e.logprob is None else _json_logprob(e.logprob)
                                   for e in entries],
                "tokens": tokens, "top_logprobs": top}

    def _chat_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token_text(token_id)
        return {"token": token, "logprob": _json_logprob(logprob),
                "bytes": list(token.encode("utf-8"))}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def stream_role_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open every choice with the assistant role, as vLLM and OpenAI do."""
        if self.kind != "chat":
            return None
        return self._envelope("chat.completion.chunk", [{
            "index": index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}])

    def stream_chunk(self, index: int, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None = None,
                     stop_reason: str | int | None = None) -> dict[str, Any]:
        rendered = self.logprobs(index, logprobs)
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": rendered,
                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": rendered,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._envelope(obj, [choice])

    def stream_usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage
        return body

    def response(self, choices: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        if self.kind == "chat":
            rendered = [{"index": c.index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": self.logprobs(c.index, c.logprobs),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in choices]
            body = self._envelope("chat.completion", rendered)
        else:
            rendered = [{"index": c.index, "text": c.text,
                         "logprobs": self.logprobs(c.index, c.logprobs),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in choices]
            body = self._envelope("text_completion", rendered)
        body["usage"] = usage
        return body


def _json_logprob(logprob: float) -> float:
    """JSON has no infinities or NaN: what is not above the floor is written as the floor."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def embedding_response(model: str, vectors: list[list[float]], token_counts: list[int],
                       encoding_format: str) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        embedding: Any = vector
        if encoding_format == "base64":
            # The OpenAI client decodes base64 as little-endian float32.
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    prompt_tokens = sum(token_counts)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
