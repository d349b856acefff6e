"""The execution plan: every dtype and backend choice of the engine, resolved once.

EngineConfig says what was asked for ("auto" included); the plan says what runs here, decided
from the checkpoint's dtype and what this CPU and toolchain (or GPU) can do. The engine sizes the
KV cache from it, and the runner and the model read it and decide nothing themselves.

There are two device back ends, chosen here and nowhere else. CPU: oneDNN-packed weights and
the compiled C kernels (csrc/), each with a torch fallback. CUDA: half-precision weights and
torch ops on the GPU, prefill attention by SDPA and decode attention over the paged cache by
SDPA over gathered blocks (the torch path the CPU falls back to, on the device).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.engine import kernels
from runtime.engine.config import EngineConfig, parse_device
from runtime.engine.loader import TORCH_DTYPES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionPlan:
    weight_dtype: torch.dtype  # what the matmuls multiply by
    # The residual stream, norms, rotary and decode attention. bf16 weights keep float32
    # activations where the kernels run (their arithmetic is float32): each matmul converts
    # its input to bf16 and its output back.
    activation_dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    linear_backend: str  # "onednn" (weights packed once) or "torch" (F.linear)
    # The compiled attention and element-wise ops (csrc/), or None for torch ops, with decode
    # attention by SDPA over gathered blocks.
    kernels: kernels.CpuKernels | None
    # "kernel": prefill chunks are attended in place from their blocks, in float32; "sdpa":
    # by SDPA in prefill_attention_dtype.
    prefill_attention: str
    prefill_attention_dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @property
    def ops_backend(self) -> str:
        return "torch" if self.kernels is None else "kernels"

    def describe(self) -> str:
        where = "" if self.device.type == "cpu" else f"on {self.device}: "
        return (f"{where}weights {dtype_name(self.weight_dtype)}, activations "
                f"{dtype_name(self.activation_dtype)}, KV cache {dtype_name(self.kv_cache_dtype)}; "
                f"linear {self.linear_backend}, ops {self.ops_backend}, prefill attention "
                f"{self.prefill_attention} in {dtype_name(self.prefill_attention_dtype)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack (and so natively multiply) weights of `dtype` on this CPU: bf16
    wants AVX512BW/VL/DQ or AVX-NE-CONVERT, fp16 AVX512-FP16 or AVX-NE-CONVERT."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except (RuntimeError, AttributeError):
        return False
    return True


def cpu_has_amx() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cuda_unavailable_reason(index: int | None) -> str | None:
    """None where CUDA device `index` (None: the current one) can run the engine; else why not."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"torch {torch.__version__} ({build}) sees no CUDA device: install a CUDA build of "
                "torch on a GPU node, check CUDA_VISIBLE_DEVICES, or serve with --device cpu")
    if index is not None and index >= torch.cuda.device_count():
        return (f"cuda:{index} does not exist: {torch.cuda.device_count()} CUDA device(s) are visible "
                "(indexes count from 0 within CUDA_VISIBLE_DEVICES)")
    return None


def cuda_bf16_supported() -> bool:
    return torch.cuda.is_bf16_supported()


def resolve_plan(
    config: EngineConfig,
    checkpoint_dtype: str,
    *,
    packs: Callable[[torch.dtype], bool] = onednn_packs,
    load_kernels: Callable[[], kernels.CpuKernels] = kernels.cpu_kernels,
    has_amx: Callable[[], bool] = cpu_has_amx,
    cuda_reason: Callable[[int | None], str | None] = cuda_unavailable_reason,
    bf16_on_gpu: Callable[[], bool] = cuda_bf16_supported,
) -> ExecutionPlan:
    """The plan for `config` over a checkpoint stored in `checkpoint_dtype` (config.json's
    name for it). The keyword arguments are what this machine can do: whether oneDNN
    multiplies a dtype natively, the compiled kernels (raising KernelUnavailableError where
    they cannot be built), whether the CPU has AMX tiles, whether a CUDA device is usable and
    takes bf16. Raises ValueError where an explicit choice cannot run here; "auto" falls back
    with a warning."""
    kind, index = parse_device(config.device)
    if kind == "cuda":
        return cuda_plan(config, checkpoint_dtype, index, cuda_reason, bf16_on_gpu)
    weights = weight_dtype(config.dtype, checkpoint_dtype, packs)
    ops, activations = ops_kernels(config.ops_backend, weights, load_kernels)
    kv = weights if config.kv_cache_dtype == "auto" else TORCH_DTYPES[config.kv_cache_dtype]
    prefill_dtype = prefill_attention_dtype(activations, kv, has_amx())
    in_place = ops is not None and prefill_dtype == torch.float32
    return ExecutionPlan(
        weight_dtype=weights,
        activation_dtype=activations,
        kv_cache_dtype=kv,
        linear_backend=linear_backend(config.linear_backend, weights, packs),
        kernels=ops,
        prefill_attention="kernel" if in_place else "sdpa",
        prefill_attention_dtype=prefill_dtype,
    )


def weight_dtype(
    requested: str, checkpoint_dtype: str, packs: Callable[[torch.dtype], bool]
) -> torch.dtype:
    """An explicit dtype is kept. `auto` follows the checkpoint (float32 when it names none
    we know), except that a half-precision checkpoint loads in float32 where oneDNN cannot
    multiply its dtype natively: emulated half-precision matmuls are several times slower."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    name = checkpoint_dtype.removeprefix("torch.")
    dtype = TORCH_DTYPES.get(name, torch.float32)
    if dtype != torch.float32 and not packs(dtype):
        logger.warning(
            "the checkpoint is %s, but this CPU has no native %s matmul; loading it in float32 "
            "(several times faster here, twice the weight memory). Pass --dtype %s to keep it.",
            name, name, name,
        )
        return torch.float32
    return dtype


def ops_kernels(
    requested: str, weights: torch.dtype, load_kernels: Callable[[], kernels.CpuKernels]
) -> tuple[kernels.CpuKernels | None, torch.dtype]:
    """The compiled kernels for EngineConfig.ops_backend (None: torch ops) and the activations'
    dtype. The kernels run float32 activations, which bf16 weights get too: torch's own bf16
    element-wise ops and attention are slower on CPU than the kernels in float32. "kernels"
    raises ValueError where they cannot run; "auto" falls back with a warning."""
    if requested == "torch":
        return None, weights
    if weights in (torch.float32, torch.bfloat16):
        try:
            return load_kernels(), torch.float32
        except kernels.KernelUnavailableError as error:
            reason = str(error)
    else:
        reason = f"the kernels are float32 only, the model runs in {dtype_name(weights)}"
    if requested == "kernels":
        raise ValueError(f"ops backend 'kernels' cannot run here: {reason}")
    logger.warning("attention and element-wise ops fall back to torch: %s", reason)
    return None, weights


def prefill_attention_dtype(
    activations: torch.dtype, kv_cache: torch.dtype, amx: bool
) -> torch.dtype:
    """The dtype SDPA attends prefill chunks in. Float32 activations over a bf16 cache attend
    in bf16 where the CPU has AMX: torch's flash attention runs bf16 on AMX tiles 2-3x faster
    than float32 (vLLM attends in bf16 too); without AMX bf16 gains nothing, so float32."""
    if activations == torch.float32 and kv_cache == torch.bfloat16 and amx:
        return torch.bfloat16
    return activations


def linear_backend(
    requested: str, weights: torch.dtype, packs: Callable[[torch.dtype], bool]
) -> str:
    """"auto" packs the weights for oneDNN where it multiplies their dtype here (it has no
    fp16 path without AVX512-FP16, for one), else F.linear. "onednn" raises ValueError where
    it cannot."""
    if requested == "torch":
        return "torch"
    if packs(weights):
        return "onednn"
    if requested == "onednn":
        raise ValueError(f"linear backend 'onednn' cannot run here: oneDNN cannot multiply "
                         f"{dtype_name(weights)} weights on this CPU")
    return "torch"


def cuda_plan(
    config: EngineConfig,
    checkpoint_dtype: str,
    index: int | None,
    cuda_reason: Callable[[int | None], str | None],
    bf16_on_gpu: Callable[[], bool],
) -> ExecutionPlan:
    """Weights, activations and the KV cache in one half-precision dtype on the GPU; torch ops
    throughout. `auto` keeps a half-precision checkpoint's dtype and runs a float32 one in bf16
    (fp16 where the GPU has no bf16), as vLLM does; float32 is kept only when asked for."""
    reason = cuda_reason(index)
    if reason is not None:
        raise ValueError(f"--device {config.device} cannot run here: {reason}")
    if config.ops_backend == "kernels" or config.linear_backend == "onednn":
        raise ValueError("--ops-backend kernels and --linear-backend onednn are CPU back ends; "
                         f"with --device {config.device} leave them at auto or torch")
    half = torch.bfloat16 if bf16_on_gpu() else torch.float16
    if config.dtype != "auto":
        weights = TORCH_DTYPES[config.dtype]
        if weights == torch.bfloat16 and half != torch.bfloat16:
            raise ValueError("this GPU has no bfloat16 arithmetic: use --dtype float16")
    else:
        weights = TORCH_DTYPES.get(checkpoint_dtype.removeprefix("torch."), torch.float32)
        if weights == torch.float32 or (weights == torch.bfloat16 and half != torch.bfloat16):
            weights = half
    kv = weights if config.kv_cache_dtype == "auto" else TORCH_DTYPES[config.kv_cache_dtype]
    return ExecutionPlan(
        weight_dtype=weights,
        activation_dtype=weights,
        kv_cache_dtype=kv,
        linear_backend="torch",
        kernels=None,
        prefill_attention="sdpa",
        prefill_attention_dtype=weights,
        device=torch.device("cuda", index if index is not None else 0),
    )
