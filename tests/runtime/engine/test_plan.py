"""The execution plan: every "auto" and dtype resolved once, by exact rules, with the
warnings that say what fell back. Pure: the machine's abilities are passed in, no model is
loaded."""

from __future__ import annotations

import logging

import pytest
import torch

from runtime.engine import kernels
from runtime.engine.config import EngineConfig
from runtime.engine.plan import (
    linear_backend,
    ops_kernels,
    prefill_attention_dtype,
    resolve_plan,
    weight_dtype,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
KERNELS = object()  # stands in for the compiled kernels


def builds():
    return KERNELS


def no_compiler():
    raise kernels.KernelUnavailableError("no C compiler (cc or gcc; install gcc, or set CC)")


def plan_for(checkpoint="float32", *, native=frozenset({F32}), load_kernels=builds, amx=False,
             **options):
    return resolve_plan(EngineConfig(model="unused", **options), checkpoint,
                        packs=lambda dtype: dtype in native, load_kernels=load_kernels,
                        has_amx=lambda: amx)


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="runtime.engine.plan")
    return caplog


@pytest.mark.parametrize(("requested", "checkpoint", "native", "expected", "warned"), [
    ("auto", "bfloat16", True, BF16, False),
    ("auto", "bfloat16", False, F32, True),  # emulated bf16 matmuls are several times slower
    ("auto", "torch.float16", False, F32, True),
    ("auto", "float32", False, F32, False),
    ("auto", "int8", True, F32, False),  # a dtype the loader does not know
    ("bfloat16", "float32", False, BF16, False),  # an explicit choice is kept
    ("bfloat16", "bfloat16", False, BF16, False),
    ("float32", "bfloat16", True, F32, False),
])
def test_weight_dtype(requested, checkpoint, native, expected, warned, warnings):
    assert weight_dtype(requested, checkpoint, lambda dtype: native) == expected
    assert ("loading it in float32" in warnings.text) == warned
    if warned:
        assert "Pass --dtype" in warnings.text


@pytest.mark.parametrize(("requested", "weights", "expected"), [
    ("torch", F32, (None, F32)),
    ("torch", BF16, (None, BF16)),  # torch ops: bf16 throughout
    ("auto", F32, (KERNELS, F32)),
    ("kernels", F32, (KERNELS, F32)),
    ("auto", BF16, (KERNELS, F32)),  # bf16 matmuls between float32 kernels
    ("kernels", BF16, (KERNELS, F32)),
])
def test_ops_where_the_kernels_build(requested, weights, expected, warnings):
    assert ops_kernels(requested, weights, builds) == expected
    assert warnings.text == ""


def test_torch_ops_never_build_the_kernels():
    assert ops_kernels("torch", F32, no_compiler) == (None, F32)


@pytest.mark.parametrize("weights", [F32, BF16])
def test_without_a_compiler_auto_falls_back_to_torch_ops_and_kernels_refuses(weights, warnings):
    assert ops_kernels("auto", weights, no_compiler) == (None, weights)
    assert "attention and element-wise ops fall back to torch: no C compiler" in warnings.text
    with pytest.raises(ValueError, match="ops backend 'kernels' cannot run here: no C compiler"):
        ops_kernels("kernels", weights, no_compiler)


def test_float16_weights_run_torch_ops(warnings):
    assert ops_kernels("auto", F16, builds) == (None, F16)
    assert "fall back to torch: the kernels are float32 only" in warnings.text
    with pytest.raises(ValueError, match="float32 only, the model runs in float16"):
        ops_kernels("kernels", F16, builds)


@pytest.mark.parametrize(("activations", "kv", "amx", "expected"), [
    (F32, BF16, True, BF16),  # bf16 weights with the kernels, on AMX tiles
    (F32, BF16, False, F32),  # without AMX, bf16 attention gains nothing
    (F32, F32, True, F32),  # a float32 model stays exact
    (BF16, BF16, True, BF16),  # torch ops: bf16 throughout
    (BF16, F32, False, BF16),
])
def test_prefill_attention_dtype(activations, kv, amx, expected):
    assert prefill_attention_dtype(activations, kv, amx) == expected


@pytest.mark.parametrize(("requested", "native", "expected"), [
    ("torch", True, "torch"),
    ("auto", True, "onednn"),
    ("auto", False, "torch"),  # oneDNN without a path for the dtype (fp16 without AVX512-FP16)
    ("onednn", True, "onednn"),
])
def test_linear_backend(requested, native, expected):
    assert linear_backend(requested, F16, lambda dtype: native) == expected


def test_onednn_is_refused_where_it_cannot_multiply_the_weights():
    with pytest.raises(ValueError, match="linear backend 'onednn' cannot run here.*float16"):
        linear_backend("onednn", F16, lambda dtype: False)


def test_a_float32_model_with_the_kernels():
    plan = plan_for()
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (F32, F32, F32)
    assert plan.kernels is KERNELS and plan.ops_backend == "kernels"
    assert plan.linear_backend == "onednn"
    assert (plan.prefill_attention, plan.prefill_attention_dtype) == ("kernel", F32)
    assert plan.describe() == ("weights float32, activations float32, KV cache float32; "
                               "linear onednn, ops kernels, prefill attention kernel in float32")


def test_a_bf16_checkpoint_without_native_bf16_loads_in_float32(warnings):
    plan = plan_for("bfloat16")
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (F32, F32, F32)
    assert "the checkpoint is bfloat16" in warnings.text


def test_an_explicit_bf16_is_kept_and_onednn_falls_back_where_it_cannot_pack(warnings):
    plan = plan_for("bfloat16", dtype="bfloat16")
    # Activations float32 for the kernels; the KV cache follows the weights ("auto").
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (BF16, F32, BF16)
    assert plan.linear_backend == "torch"
    assert (plan.prefill_attention, plan.prefill_attention_dtype) == ("kernel", F32)
    assert warnings.text == ""


def test_bf16_weights_on_amx_attend_prefills_in_bf16_by_sdpa():
    plan = plan_for("bfloat16", native={F32, BF16}, amx=True)
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (BF16, F32, BF16)
    assert plan.linear_backend == "onednn"
    assert (plan.prefill_attention, plan.prefill_attention_dtype) == ("sdpa", BF16)
    float32_cache = plan_for("bfloat16", native={F32, BF16}, amx=True, kv_cache_dtype="float32")
    assert float32_cache.kv_cache_dtype == F32
    assert float32_cache.prefill_attention == "kernel"


def test_bf16_weights_with_torch_ops_stay_bf16():
    plan = plan_for("bfloat16", native={F32, BF16}, amx=True, ops_backend="torch",
                    load_kernels=no_compiler)
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (BF16, BF16, BF16)
    assert plan.kernels is None and plan.ops_backend == "torch"
    assert (plan.prefill_attention, plan.prefill_attention_dtype) == ("sdpa", BF16)


def test_a_bf16_kv_cache_for_a_float32_model():
    plan = plan_for(kv_cache_dtype="bfloat16")
    assert (plan.weight_dtype, plan.activation_dtype, plan.kv_cache_dtype) == (F32, F32, BF16)
    assert plan.prefill_attention == "kernel"  # the kernel reads a bf16 cache as float32
    assert plan_for(kv_cache_dtype="bfloat16", amx=True).prefill_attention_dtype == BF16


def test_without_a_compiler_the_plan_runs_torch_ops(warnings):
    plan = plan_for("bfloat16", dtype="bfloat16", load_kernels=no_compiler)
    assert (plan.activation_dtype, plan.kernels) == (BF16, None)
    assert (plan.prefill_attention, plan.prefill_attention_dtype) == ("sdpa", BF16)
    assert "fall back to torch: no C compiler" in warnings.text
    with pytest.raises(ValueError, match="ops backend 'kernels' cannot run here"):
        plan_for(ops_backend="kernels", load_kernels=no_compiler)


def test_the_real_loader_without_a_compiler_falls_back(tmp_path, monkeypatch, warnings):
    monkeypatch.setenv("INFEROPS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels.load.cache_clear()
    kernels.cpu_kernels.cache_clear()
    try:
        plan = resolve_plan(EngineConfig(model="unused"), "float32")
    finally:
        kernels.load.cache_clear()
        kernels.cpu_kernels.cache_clear()
    assert plan.kernels is None and plan.prefill_attention == "sdpa"
    assert "no-such-compiler" in warnings.text


def test_the_plan_is_frozen():
    plan = plan_for()
    with pytest.raises(AttributeError):
        plan.kernels = None


# -- the CUDA back end (the GPU's abilities passed in, so these run without one) --------------

def cuda_plan_for(checkpoint="float32", *, bf16=True, reason=None, **options):
    return resolve_plan(EngineConfig(model="unused", device=options.pop("device", "cuda"), **options),
                        checkpoint, packs=lambda dtype: True, load_kernels=builds, has_amx=lambda: True,
                        cuda_reason=lambda index: reason, bf16_on_gpu=lambda: bf16)


@pytest.mark.parametrize(("checkpoint", "requested", "bf16", "expected"), [
    ("float32", "auto", True, BF16),  # vLLM's rule: a float32 checkpoint serves in bf16 on a GPU
    ("float32", "auto", False, F16),  # a GPU without bf16 (before Ampere)
    ("bfloat16", "auto", True, BF16),
    ("bfloat16", "auto", False, F16),
    ("float16", "auto", True, F16),
    ("float32", "float32", True, F32),  # kept when asked for (the parity tests)
    ("bfloat16", "float16", True, F16),
])
def test_the_cuda_back_end_runs_torch_ops_in_one_dtype_on_the_device(checkpoint, requested, bf16, expected):
    plan = cuda_plan_for(checkpoint, dtype=requested, bf16=bf16)
    assert plan.device == torch.device("cuda", 0)
    assert plan.weight_dtype == plan.activation_dtype == plan.kv_cache_dtype == expected
    assert plan.prefill_attention_dtype == expected
    assert (plan.linear_backend, plan.ops_backend, plan.prefill_attention) == ("torch", "torch", "sdpa")
    assert plan.describe().startswith("on cuda:0: weights ")


def test_the_cuda_back_end_names_its_device_and_refuses_cpu_only_choices():
    assert cuda_plan_for(device="cuda:1").device == torch.device("cuda", 1)
    assert cuda_plan_for(kv_cache_dtype="float32").kv_cache_dtype == F32
    with pytest.raises(ValueError, match="CPU back ends"):
        cuda_plan_for(ops_backend="kernels")
    with pytest.raises(ValueError, match="CPU back ends"):
        cuda_plan_for(linear_backend="onednn")
    with pytest.raises(ValueError, match="no bfloat16 arithmetic: use --dtype float16"):
        cuda_plan_for(dtype="bfloat16", bf16=False)
    with pytest.raises(ValueError, match="--device cuda:3 cannot run here: only two"):
        cuda_plan_for(device="cuda:3", reason="only two")


def test_without_cuda_the_refusal_says_what_to_do():
    # This machine's torch is the CPU build: the real check, not a stand-in.
    with pytest.raises(ValueError, match=r"--device cuda cannot run here: torch .* sees no CUDA device.*--device cpu"):
        resolve_plan(EngineConfig(model="unused", device="cuda"), "float32")


@pytest.mark.parametrize(("device", "error"), [
    ("gpu", "device must be cpu, cuda or cuda:N"), ("cuda:x", "device must be"), ("cpu:0", "device must be")])
def test_engine_config_refuses_unknown_devices(device, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(model="unused", device=device)


@pytest.mark.parametrize("share", [0, -0.5, 1.01])
def test_engine_config_refuses_a_gpu_share_outside_0_to_1(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(model="unused", gpu_memory_utilization=share)
