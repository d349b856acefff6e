"""Tokenizer: special tokens, chat templates (own and fallback), incremental detokenizing."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.engine.tokenizer import (
    REPLACEMENT_CHAR,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello world!"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def copy_tokenizer_dir(src, dst, **config_changes):
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_bos_is_added_once_and_only_with_special_tokens(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids.count(1) == 1
    assert tokenizer.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>Hello world"


def test_eos_ids_come_from_tokenizer_and_model_configs(tiny_llama_dir, tmp_path):
    assert Tokenizer.from_dir(tiny_llama_dir).eos_token_ids == [2]
    copy_tokenizer_dir(tiny_llama_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [2, 9, 7]


def test_checkpoint_chat_template_renders_with_bos_eos_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == ("<s><|system|>\nBe brief.</s>\n<|user|>\nHello world!</s>\n<|assistant|>\n")
    without = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert not without.endswith("<|assistant|>\n")


def test_template_raise_exception_becomes_a_clear_error(tokenizer):
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_content_parts_are_flattened_to_text(tokenizer):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        }
    ]
    assert "<|user|>\nHello</s>" in tokenizer.apply_chat_template(parts)


def test_fallback_template_when_the_checkpoint_has_none(tiny_llama_dir, tmp_path):
    copy_tokenizer_dir(tiny_llama_dir, tmp_path, chat_template=None)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.chat_template is None
    assert tokenizer.apply_chat_template(MESSAGES) == (
        "<|system|>\nBe brief.\n<|user|>\nHello world!\n<|assistant|>\n"
    )


def test_named_templates_and_template_file(tiny_llama_dir, tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "a").mkdir()
    copy_tokenizer_dir(tiny_llama_dir, tmp_path / "a", chat_template=named)
    assert Tokenizer.from_dir(tmp_path / "a").apply_chat_template(MESSAGES) == "D"
    (tmp_path / "b").mkdir()
    copy_tokenizer_dir(tiny_llama_dir, tmp_path / "b", chat_template=None)
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path / "b").apply_chat_template(MESSAGES) == "2"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def stream(tokenizer, prompt_ids, output_ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop))
    deltas = []
    for i in range(1, len(output_ids) + 1):
        delta, stopped = detok.update(output_ids[:i], finished=i == len(output_ids))
        deltas.append(delta)
        if stopped:
            return deltas, True
    return deltas, False


def test_multi_byte_characters_are_never_emitted_half_done(tokenizer):
    text = " Grüße aus 東京 🙂 café"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE splits several characters over more than one token.
    partial = [tokenizer.decode(output_ids[:i]) for i in range(1, len(output_ids))]
    assert any(REPLACEMENT_CHAR in p for p in partial)
    deltas, stopped = stream(tokenizer, tokenizer.encode("Hello"), output_ids)
    assert not stopped
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text


def test_leading_space_of_the_first_output_token_survives(tokenizer):
    prompt = tokenizer.encode("Hello")
    output_ids = tokenizer.encode(" world", add_special_tokens=False)
    assert "".join(stream(tokenizer, prompt, output_ids)[0]) == " world"


def test_stop_string_cuts_the_text_before_it(tokenizer):
    output_ids = tokenizer.encode(" The quick brown fox jumps", add_special_tokens=False)
    deltas, stopped = stream(tokenizer, [1], output_ids, stop=["brown"])
    assert stopped
    detok = IncrementalDetokenizer(tokenizer, [1], ["jumps", "brown", "quick"])
    assert detok.update(output_ids, finished=False)[1] == "quick"  # the earliest match
    assert "".join(deltas) == " The quick "


def test_a_possible_stop_string_start_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], ["xyz!"])
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    delta, stopped = detok.update(ids, finished=False)
    assert (delta, stopped) == ("Hello wo", None)  # the last 3 characters could start "xyz!"
    assert detok.flush(ids) == "rld"


def first_cut_inside_a_character(tokenizer, ids):
    return next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT_CHAR))


def test_an_output_ending_inside_a_character_gives_its_bytes_at_the_end(tokenizer):
    ids = tokenizer.encode(" Tokyo 東京", add_special_tokens=False)
    cut = first_cut_inside_a_character(tokenizer, ids)
    deltas, _ = stream(tokenizer, tokenizer.encode("Hello"), ids[:cut])
    assert "".join(deltas) == tokenizer.decode(ids[:cut])
    assert deltas[-1].endswith(REPLACEMENT_CHAR)
    assert all(REPLACEMENT_CHAR not in d for d in deltas[:-1])


def test_a_prompt_ending_inside_a_character_keeps_it_out_of_the_output(tokenizer):
    ids = tokenizer.encode("東京", add_special_tokens=False)
    cut = first_cut_inside_a_character(tokenizer, ids)
    output_ids = tokenizer.encode(" and Osaka", add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids[:cut], output_ids)
    assert "".join(deltas) == " and Osaka"


def test_a_stream_that_refuses_a_token_falls_back_to_decoding_the_whole_output(tokenizer):
    """tokenizers' DecodeStream raises when a decoder rewrote text it had already given; the
    detokenizer then decodes the output as a whole and goes on with a fresh stream."""

    class RefusesOnce:
        def __init__(self, stream):
            self.stream, self.refused = stream, False

        def step(self, backend, token_id):
            if not self.refused:
                self.refused = True
                raise Exception("Invalid prefix encountered")  # what tokenizers raises
            return self.stream.step(backend, token_id)

    prompt = tokenizer.encode("Hello")
    output_ids = tokenizer.encode(" brave new world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    detok._stream = RefusesOnce(detok._stream)
    deltas = [detok.update(output_ids[:i], finished=i == len(output_ids))[0]
              for i in range(1, len(output_ids) + 1)]
    assert "".join(deltas) == " brave new world"
