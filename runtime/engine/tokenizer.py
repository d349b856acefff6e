"""Tokenizer of a local HF checkpoint: `tokenizers` for the text, jinja2 for the chat template.

Read from the checkpoint directory:

- `tokenizer.json` (required), loaded with the `tokenizers` library;
- `tokenizer_config.json`: `bos_token` / `eos_token` (strings or `{"content": ...}`),
  `add_bos_token` / `add_eos_token`, and `chat_template` (a string, or a list of named
  templates of which `default` is used); a `chat_template.jinja` file also counts;
- `config.json` and `generation_config.json`: extra `eos_token_id`s (int or list).

Chat templates render in a sandboxed jinja2 environment with `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception()` and a `tojson` filter,
as transformers does. When the checkpoint has no template, this fallback is used::

    <|system|>
    You are terse.
    <|user|>
    Hi
    <|assistant|>

i.e. `<|{role}|>\\n{content}\\n` per message, then `<|assistant|>\\n` when
`add_generation_prompt` is true.

`IncrementalDetokenizer` turns a growing list of output ids into text deltas: a
`tokenizers` DecodeStream (read a few prompt tokens first, so a leading space survives) gives
each token's text once its characters are complete; the detokenizer holds back the last
`len(longest stop string) - 1` characters and cuts at stop strings.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers.decoders import DecodeStream

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens a detokenizer reads before the output, so the first output token decodes as
# it would after the prompt.
DETOKENIZE_CONTEXT_TOKENS = 4


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception) or failed to render."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


class Tokenizer:
    def __init__(
        self,
        backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.add_eos_token = add_eos_token and self.eos_token_id is not None
        self.chat_template = chat_template
        eos_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        for token_id in extra_eos_token_ids or []:
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        self.eos_token_ids: list[int] = eos_ids
        self._compiled_template = None
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as BackendTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in checkpoint directory {model_dir}")
        config = _read_json(model_dir / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        extra_eos = _as_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))
        extra_eos += _as_id_list(
            _read_json(model_dir / "generation_config.json").get("eos_token_id")
        )
        return cls(
            BackendTokenizer.from_file(str(path)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=template,
            extra_eos_token_ids=extra_eos,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            # tokenizer.json's post-processor may already add them; never twice.
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and (not ids or ids[-1] != self.eos_token_id):
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens included: how logprobs name a token,
        as vLLM's do. Cached, since a stream asks for the same few tokens again and again."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode(
                [token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        template = self._template()
        try:
            return template.render(
                messages=[_flatten_content(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template bug must surface as a clear client error
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

    def _template(self):
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._compiled_template = env.from_string(self.chat_template or FALLBACK_CHAT_TEMPLATE)
        return self._compiled_template


def _raise_template_error(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _flatten_content(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) become one string."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
        )
        return {**message, "content": text}
    return message


class IncrementalDetokenizer:
    """Text deltas for one sequence's growing output ids.

    The text comes from the tokenizers library's `DecodeStream`, which decodes a short window
    of the latest tokens in Rust and keeps back a token whose character is not complete yet
    (several times cheaper per token than decoding windows from Python). The stream is primed
    with the prompt's last few tokens, so that the first output token joins them as it would
    in the full text (a WordPiece `##` piece, a SentencePiece leading space).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.context_ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self.stop = list(stop)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # emitted so far (stop strings never included)
        self._stream = self._stream_after(self.context_ids)
        self._num_output = 0  # output ids stepped into the stream
        self._num_held = 0  # trailing output ids the stream holds back (a partial character)
        self._decoded = ""  # text of all output ids read so far
        self._searched_upto = 0  # stop strings cannot start before this index of _decoded

    def _stream_after(self, ids: list[int]) -> DecodeStream:
        """A stream that has read `ids`, or an empty one where they end in a partial
        character (it would come out as part of the output's text)."""
        stream = DecodeStream(skip_special_tokens=True)
        if ids and self.tokenizer.decode(ids).endswith(REPLACEMENT_CHAR):
            return stream
        for token_id in ids:
            stream.step(self.tokenizer.backend, token_id)
        return stream

    def _advance(self, output_ids: list[int], finished: bool) -> None:
        """Extend `_decoded` with the text of the output ids not read yet."""
        for position in range(self._num_output, len(output_ids)):
            try:
                piece = self._stream.step(self.tokenizer.backend, output_ids[position])
            except Exception:  # noqa: BLE001 - the stream raises when a decoder rewrote
                # text it had already given (the new window does not extend the old one):
                # take the output as a whole and carry on from there.
                read = output_ids[: position + 1]
                self._decoded = self._decode_all(read)
                self._stream = self._stream_after(
                    (self.context_ids + read)[-DETOKENIZE_CONTEXT_TOKENS:]
                )
                self._num_held = 0
                continue
            if piece is None:
                self._num_held += 1
            else:
                self._decoded += piece
                self._num_held = 0
        self._num_output = len(output_ids)
        if finished and self._num_held:
            # The output ended inside a character: give its bytes as they decode.
            self._decoded += self.tokenizer.decode(output_ids[-self._num_held :])
            self._num_held = 0

    def _decode_all(self, output_ids: list[int]) -> str:
        context_text = self.tokenizer.decode(self.context_ids) if self.context_ids else ""
        if self.context_ids and not context_text.endswith(REPLACEMENT_CHAR):
            full = self.tokenizer.decode(self.context_ids + list(output_ids))
            if full.startswith(context_text):
                return full[len(context_text) :]
        return self.tokenizer.decode(output_ids)

    def update(self, output_ids: list[int], finished: bool,
               check_stop: bool = True) -> tuple[str, str | None]:
        """Return (new text, the stop string that ended the output or None). With
        `check_stop` False (min_tokens not reached) a stop string in the text so far does not
        count, now or later, as in vLLM."""
        self._advance(output_ids, finished)
        text = self._decoded
        if not finished:
            text = text.rstrip(REPLACEMENT_CHAR)
        stop_at, matched = -1, None
        if self.stop:
            # Earlier updates found no stop string in the text they saw, so a new one ends in
            # what was added since: search from its first possible start only.
            start = max(0, self._searched_upto - self.max_stop_len + 1)
            if check_stop:
                stop_at, matched = min(((i, s) for s in self.stop
                                        if (i := text.find(s, start)) >= 0),
                                       default=(-1, None))
            self._searched_upto = len(text)
        if matched is not None:
            text = text[:stop_at]
        emit_upto = len(text) if (finished or matched is not None) \
            else len(text) - self.hold_back
        if emit_upto <= len(self.text):
            return "", matched
        delta = text[len(self.text) : emit_upto]
        self.text += delta
        return delta, matched

    def flush(self, output_ids: list[int]) -> str:
        """The held-back text once the sequence finished for another reason."""
        return self.update(output_ids, finished=True)[0]
