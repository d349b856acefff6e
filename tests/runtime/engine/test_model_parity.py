"""Greedy output of the engine equals transformers' generate, token for token (fp32).

Each case is a tiny random checkpoint; the engine runs every prompt at once with blocks smaller
than the prompts and a token budget small enough that prompts span several prefill chunks.
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime.engine.config import ModelConfig
from runtime.engine.kernels import unavailable_reason
from runtime.engine.loader import load_state_dict, safetensors_files
from runtime.engine.plan import onednn_packs
from runtime.engine.sampling import SamplingParams

MAX_NEW_TOKENS = 10
PROMPTS = [
    [1, 17, 42, 99, 5],
    [1, 17, 42, 99, 5, 250, 8, 61, 61, 3, 77, 120, 14, 200, 9, 33, 31, 2, 19],
    [1] + [(i * 37) % 300 + 3 for i in range(40)],
    [1, 260],
    [1, 17, 42, 99, 5, 250, 8, 61, 100, 101, 102],  # shares a prefix with the second prompt
]

# Sharp attention: with the default 0.02 init, scores are ~0 and attention is uniform, so a
# wrong rotary embedding or mask would not change a single token.
SHARP = {"initializer_range": 0.15}
CASES = {
    "llama-gqa2": ("llama", {}),
    "llama-mqa-llama3-rope-tied": (
        "llama",
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral-linear-rope": (
        "mistral",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window": None},
    ),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen2-bias-mqa-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


ONEDNN = torch.backends.mkldnn.is_available()
# Why the compiled kernels cannot run here (None where they can), shown by pytest -ra.
NO_KERNELS = unavailable_reason()
NEEDS_KERNELS = pytest.mark.skipif(NO_KERNELS is not None, reason=str(NO_KERNELS))
_hf_outputs: dict[str, list[list[int]]] = {}


def hf_greedy(model_dir, prompts, max_new_tokens=MAX_NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


# Both ways of multiplying by the weights and of reading the KV cache: oneDNN's packed weights
# and the compiled attention kernel sum in other orders than MKL and SDPA (which transformers
# uses), and the tokens must still be the same.
@pytest.mark.parametrize(
    "linear_backend,ops_backend",
    [
        pytest.param("onednn", "kernels", marks=[
            pytest.mark.skipif(not ONEDNN, reason="no oneDNN"),
            NEEDS_KERNELS,
        ]),
        ("torch", "torch"),
    ],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(
    case, linear_backend, ops_backend, checkpoint_factory, make_engine
):
    kind, overrides = CASES[case]
    model_dir = checkpoint_factory(f"parity-{case}", kind, seed=7, **SHARP, **overrides)
    if case not in _hf_outputs:
        _hf_outputs[case] = hf_greedy(model_dir, PROMPTS)
    expected = _hf_outputs[case]
    engine = make_engine(
        model_dir, block_size=4, max_num_batched_tokens=12, max_num_seqs=8,
        linear_backend=linear_backend, ops_backend=ops_backend,
    )
    assert {layer.qkv_proj.backend for layer in engine.runner.model.layers} == {linear_backend}
    assert engine.plan.ops_backend == ops_backend
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS, params) == expected
    # The fifth prompt reused the second one's computed blocks.
    assert engine.stats().prefix_cache_hits_total > 0


def test_config_reads_rope_and_architecture_facts(checkpoint_factory):
    kind, overrides = CASES["llama-mqa-llama3-rope-tied"]
    model_dir = checkpoint_factory(
        "parity-llama-mqa-llama3-rope-tied", kind, seed=7, **SHARP, **overrides
    )
    config = ModelConfig.from_dir(model_dir)
    assert config.num_kv_heads == 1 and config.tie_word_embeddings
    assert config.rope.kind == "llama3" and config.rope.theta == 50000.0
    assert config.rope.original_max_position_embeddings == 32
    legacy = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "torch_dtype": "bfloat16",
            "eos_token_id": [5, 6],
        }
    )
    assert legacy.rope.kind == "linear" and legacy.rope.factor == 4.0
    assert legacy.rope.theta == 1e6 and legacy.qkv_bias and legacy.num_kv_heads == 2
    assert legacy.checkpoint_dtype == "bfloat16" and legacy.eos_token_ids == [5, 6]
    with pytest.raises(ValueError, match="unsupported architectures"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})


def test_sharded_checkpoint_loads_every_shard(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert len(safetensors_files(tmp_path)) > 1
    sharded = load_state_dict(tmp_path, torch.float32)
    single = load_state_dict(tiny_llama_dir, torch.float32)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


@pytest.mark.parametrize("ops_backend", [
    "torch", pytest.param("kernels", marks=NEEDS_KERNELS)])
def test_bfloat16_weights_run_in_bf16(checkpoint_factory, make_engine, ops_backend):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint_factory("bf16-llama", "llama", seed=3, dtype=torch.bfloat16)
    engine = make_engine(model_dir, dtype="bfloat16", ops_backend=ops_backend)
    model = engine.runner.model
    assert engine.plan.weight_dtype == torch.bfloat16
    assert model.layers[0].gate_up_proj.dtype == model.lm_head.dtype == torch.bfloat16
    # With the (float32) kernels, activations stay float32 between bf16 matmuls; the KV cache
    # is bf16 either way (kv_cache_dtype "auto": the weights').
    activations = torch.float32 if ops_backend == "kernels" else torch.bfloat16
    assert engine.plan.activation_dtype == model.embed_tokens.dtype == activations
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    fp32_engine = make_engine(model_dir, dtype="float32", ops_backend=ops_backend)
    assert fp32_engine.runner.kv_caches[0][0].dtype == torch.float32
    assert fp32_engine.runner.model.lm_head.dtype == torch.float32
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o) for o in outputs] == [4] * len(PROMPTS)
    # Prefill logits agree with transformers' bf16 forward within bf16 rounding.
    prompt = PROMPTS[1]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1].float()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    scheduled = engine.scheduler.schedule()
    logits = engine.runner.execute(scheduled)[0][0]
    assert torch.allclose(logits, expected, atol=3e-2)


def test_auto_dtype_follows_a_bf16_checkpoint_only_where_the_cpu_multiplies_bf16(
        checkpoint_factory, make_engine):
    model_dir = checkpoint_factory("bf16-llama", "llama", seed=3, dtype=torch.bfloat16)
    engine = make_engine(model_dir)  # dtype="auto"
    native = onednn_packs(torch.bfloat16)  # this CPU: AVX-512 or AVX-NE-CONVERT
    assert engine.plan.weight_dtype == (torch.bfloat16 if native else torch.float32)
    assert engine.runner.model.lm_head.dtype == engine.plan.weight_dtype


def run_with_logprobs(engine, prompts, params_list):
    """Each prompt's output tokens and their TokenLogprobs, all prompts in one batch."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
    return list(tokens.values()), list(logprobs.values())


def reference_penalized_greedy(model, prompt, steps, repetition=1.0, frequency=0.0,
                               presence=0.0):
    """Greedy decoding with vLLM's penalties written out by hand over transformers' logits
    (no cache: the whole sequence each step), with each step's raw log-softmax."""
    ids, raw = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            raw.append(logits.log_softmax(dim=-1))
            output = ids[len(prompt):]
            for token in set(ids):
                value = logits[token]
                logits[token] = value * repetition if value < 0 else value / repetition
            for token in set(output):  # two subtractions, as vLLM makes them
                logits[token] = logits[token] - frequency * output.count(token) - presence
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], raw


def test_repetition_penalty_matches_transformers(checkpoint_factory, make_engine):
    model_dir = checkpoint_factory("parity-llama-gqa2", "llama", seed=7, **SHARP)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS,
                                   do_sample=False, repetition_penalty=1.3, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    engine = make_engine(model_dir, block_size=4, max_num_batched_tokens=12, max_num_seqs=8)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.3)
    assert engine.generate(PROMPTS, params) == expected
    # Not a test that cannot fail: the penalty changes what greedy decoding picks here.
    plain = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS, plain) != expected


def test_penalties_and_logprobs_match_a_reference_over_transformers(
    checkpoint_factory, make_engine
):
    """Every prompt twice in one batch, with all three penalties and logprobs and without
    either, so a row's penalties must not leak into its neighbours'."""
    model_dir = checkpoint_factory("parity-llama-gqa2", "llama", seed=7, **SHARP)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    penalties = {"repetition": 1.1, "frequency": 0.4, "presence": 0.3}
    penalized = [reference_penalized_greedy(model, p, MAX_NEW_TOKENS, **penalties)
                 for p in PROMPTS]
    plain = [reference_penalized_greedy(model, p, MAX_NEW_TOKENS)[0] for p in PROMPTS]
    repetition_only = [reference_penalized_greedy(model, p, MAX_NEW_TOKENS, repetition=1.1)[0]
                       for p in PROMPTS]
    # On these prompts the additive penalties change what the repetition penalty alone picks.
    assert [tokens for tokens, _ in penalized] != repetition_only != plain
    engine = make_engine(model_dir, block_size=4, max_num_batched_tokens=12, max_num_seqs=10)
    with_both = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.1, frequency_penalty=0.4,
                               presence_penalty=0.3, logprobs=3)
    neither = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, logprobs = run_with_logprobs(engine, PROMPTS * 2,
                                         [with_both] * len(PROMPTS) + [neither] * len(PROMPTS))
    assert tokens == [expected for expected, _ in penalized] + plain
    assert logprobs[len(PROMPTS):] == [[]] * len(PROMPTS)
    for (expected, raw), entries in zip(penalized, logprobs, strict=False):
        assert [e.token_id for e in entries] == expected
        for token, row, entry in zip(expected, raw, entries, strict=True):
            # Logprobs are the model's own distribution: before the penalties.
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
            top = row.topk(3)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("logits_rows", [256, 3])
def test_prompt_logprobs_match_transformers_over_chunks_and_shared_prefixes(
    logits_rows, checkpoint_factory, make_engine, monkeypatch
):
    """Prompts cut into several chunks, the fifth sharing the second's prefix: every position
    is computed (not taken from the prefix cache) and scored as transformers' forward does,
    whether a chunk's logits are made at once or a few rows at a time."""
    monkeypatch.setattr("runtime.engine.engine.PROMPT_LOGITS_ROWS", logits_rows)
    model_dir = checkpoint_factory("parity-llama-gqa2", "llama", seed=7, **SHARP)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = make_engine(model_dir, block_size=4, max_num_batched_tokens=12, max_num_seqs=8)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    reported = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                reported[out.request_id] = out.prompt_logprobs
    assert engine.stats().prefix_cache_hits_total == 0
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
        entries = reported[f"r{i}"]
        assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
        for position, entry in enumerate(entries[1:], start=1):
            row = expected[position - 1]  # what the previous position predicted
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
