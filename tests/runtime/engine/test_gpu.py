"""The engine on a CUDA device: the CPU suites' checks (greedy parity with transformers for each
architecture, the prefix cache, preemption, the sampler's features, the metrics it reports) run
again with `device="cuda"`, against transformers on the same GPU.

Marked `gpu`: they skip, with one line, where torch sees no CUDA device (this project's CI and
the CPU build of torch), and run in `make gpu-check` on a GPU machine.
"""

from __future__ import annotations

import gc

import pytest
import torch

from runtime.engine.config import EngineConfig
from runtime.engine.engine import LLMEngine
from runtime.engine.plan import cuda_unavailable_reason
from runtime.engine.sampling import SamplingParams
from tests.runtime.engine.test_model_parity import CASES, MAX_NEW_TOKENS, PROMPTS, SHARP

pytestmark = pytest.mark.gpu
if (NO_CUDA := cuda_unavailable_reason(None)) is not None:
    pytest.skip(f"the gpu tests: {NO_CUDA}", allow_module_level=True)

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def gpu_engine(model_dir, **options) -> LLMEngine:
    defaults = {"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 12, "max_num_seqs": 8,
                "device": "cuda"}
    return LLMEngine(EngineConfig(model=str(model_dir), **{**defaults, **options}))


def hf_greedy_on_gpu(model_dir, prompts, dtype=torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to("cuda").eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(autouse=True)
def no_tf32():
    """Float32 parity needs float32 matmuls: TF32 rounds their inputs to 10 bits."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


_hf_outputs: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_on_the_same_gpu(case, enforce_eager, checkpoint_factory):
    kind, overrides = CASES[case]
    model_dir = checkpoint_factory(f"parity-{case}", kind, seed=7, **SHARP, **overrides)
    if case not in _hf_outputs:
        _hf_outputs[case] = hf_greedy_on_gpu(model_dir, PROMPTS)
    engine = gpu_engine(model_dir, dtype="float32", enforce_eager=enforce_eager)
    assert (engine.runner.graphs is None) == enforce_eager  # captured, and replaying what eager computes
    assert engine.plan.device.type == "cuda" and engine.runner.kv_caches[0][0].is_cuda
    assert engine.runner.model.layers[0].qkv_proj.weight.is_cuda
    assert engine.generate(PROMPTS, GREEDY) == _hf_outputs[case]
    assert engine.stats().prefix_cache_hits_total > 0  # the fifth prompt reused the second's blocks


def test_a_float32_checkpoint_runs_in_half_precision_by_default(tiny_llama_dir):
    engine = gpu_engine(tiny_llama_dir)
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert engine.plan.weight_dtype == engine.plan.kv_cache_dtype == half
    assert engine.runner.model.lm_head.dtype == half
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [len(o) for o in outputs] == [MAX_NEW_TOKENS] * len(PROMPTS)


def test_preemption_and_prefix_cache_keep_the_greedy_output(tiny_llama_dir):
    roomy = gpu_engine(tiny_llama_dir, dtype="float32").generate(PROMPTS, GREEDY)
    # 16 blocks of 4 tokens cannot hold every sequence at once: some are preempted and recomputed.
    tight = gpu_engine(tiny_llama_dir, dtype="float32", num_kv_blocks=16)
    assert tight.generate(PROMPTS, GREEDY) == roomy
    assert tight.stats().num_preemptions_total > 0
    again = gpu_engine(tiny_llama_dir, dtype="float32")
    assert again.generate([PROMPTS[2]], GREEDY) == again.generate([PROMPTS[2]], GREEDY) == [roomy[2]]
    assert again.stats().prefix_cache_hits_total > 0


def test_every_sampling_feature_runs_on_the_gpu_and_a_seed_repeats(tiny_llama_dir):
    """Each processor and the sampler's every path make tensors on the logits' device."""
    engine = gpu_engine(tiny_llama_dir)
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=6, temperature=1.0, top_k=5, min_p=0.05, seed=2, n=2),
        SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.5, seed=3),
        SamplingParams(max_tokens=6, temperature=0.0, logit_bias={7: 100.0}, min_tokens=3),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=0.5, top_k=1000, seed=4),
    ]
    first = engine.generate(PROMPTS, params)
    assert first == engine.generate(PROMPTS, params)
    assert first[4] == [7] * 6  # a +100 bias all but forces its token, greedily
    # Logprobs and prompt logprobs come back as numbers.
    engine.add_request("lp", PROMPTS[1], params[0])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert all(len(o.logprobs[0].top) == 3 for o in outputs if o.new_token_ids)
    assert len(outputs[0].prompt_logprobs) == len(PROMPTS[1])


def test_the_kv_cache_is_sized_from_gpu_memory_utilization(tiny_llama_dir):
    gc.collect()  # earlier tests' engines
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.3,
                                    max_num_batched_tokens=256))
    reserved = torch.cuda.memory_reserved()
    # The tiny model's weights are a few MB: nearly all of the 30 % is KV cache, and no more.
    assert reserved <= 0.3 * total
    kv = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    assert kv > 0.25 * total - (total - free)
    stats = engine.stats()
    assert stats.num_kv_blocks == engine.num_kv_blocks and stats.kv_cache_usage == 0
    engine.generate(PROMPTS, GREEDY)
    assert engine.stats().generation_tokens_total == MAX_NEW_TOKENS * len(PROMPTS)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.0001))
