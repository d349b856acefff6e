"""GPU types and whether a model version fits them, checked before a replica is started.

A version needs its weights plus the KV cache of `max_num_seqs` sequences at full context
(`max_model_len`, else the version's max context) to fit in `gpu_memory_utilization` of the
memory of its `gpu_count` GPUs: with tensor and pipeline parallelism the weights and the cache
are split across them. This is a bound inferops can check from registry facts alone, so an
impossible deployment is refused with the figures rather than crash-looping on the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from registry.checkpoint import DTYPE_BYTES

MIB = 1024 ** 2
GIB = 1024 ** 3

# Total memory per device as `nvidia-smi` reports it, for the `resources.gpu_type` names.
GPU_MEMORY_BYTES: dict[str, int] = {
    "nvidia-h200": 143771 * MIB,
    "nvidia-h100": 81559 * MIB,
    "nvidia-a100-80gb": 81920 * MIB,
    "nvidia-a100-40gb": 40960 * MIB,
    "nvidia-l40s": 46068 * MIB,
    "nvidia-l4": 23034 * MIB,
    "nvidia-a10g": 23028 * MIB,
    "nvidia-t4": 15360 * MIB,
    "nvidia-v100-32gb": 32768 * MIB,
    "nvidia-v100-16gb": 16384 * MIB,
}
# Peak dense (no 2:4 sparsity) BF16 tensor-core TFLOP/s per device, the denominator of model FLOPs
# utilisation, from NVIDIA's data sheets (which print the sparse figure, twice these, first).
# T4 and V100 have no BF16: their FP16 tensor-core peak.
PEAK_DENSE_BF16_TFLOPS: dict[str, float] = {
    "nvidia-h200": 989.0,  # H200 SXM
    "nvidia-h100": 989.0,  # H100 SXM; the PCIe card's is 756
    "nvidia-a100-80gb": 312.0,
    "nvidia-a100-40gb": 312.0,
    "nvidia-l40s": 362.0,  # 362.05
    "nvidia-l4": 121.0,
    # AWS's A10G, not the A10 (125): as MosaicML Composer's speed monitor and Baseten's "A10 vs A10G"
    # comparison give it.
    "nvidia-a10g": 70.0,
    "nvidia-t4": 65.0,  # FP16
    "nvidia-v100-32gb": 125.0,  # FP16, SXM2 (PCIe: 112)
    "nvidia-v100-16gb": 125.0,
}
# What each backend reserves of a GPU unless engine_args says otherwise (vLLM's own default).
DEFAULT_MEMORY_UTILIZATION = {"vllm": 0.9, "builtin": 0.9}
# With no max_num_seqs given, one full-length sequence: the least vLLM itself needs to start.
DEFAULT_SEQUENCES = 1


def known_type(gpu_type: str) -> str | None:
    """The table's name for gpu_type ("H100" and "nvidia-h100" alike), None when not in it.

    A type not in the table is still accepted (a Kubernetes node label may name any product),
    but its memory cannot be checked.
    """
    name = gpu_type.strip().lower()
    name = name if name.startswith("nvidia-") else f"nvidia-{name}"
    return name if name in GPU_MEMORY_BYTES else None


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryNeed:
    weight_bytes: int
    kv_bytes: int
    sequences: int
    context: int
    available_bytes: int

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def explain(self, gpu_type: str, gpu_count: int, utilization: float) -> str:
        return (f"needs {self.needed_bytes} bytes ({gib(self.needed_bytes)}: weights {gib(self.weight_bytes)} + "
                f"KV cache {gib(self.kv_bytes)} for max_num_seqs {self.sequences} x {self.context} tokens), "
                f"but {gpu_count} x {gpu_type} at gpu_memory_utilization {utilization} give "
                f"{self.available_bytes} bytes ({gib(self.available_bytes)}); lower max_num_seqs or "
                f"max_model_len, or use more or larger GPUs")


def memory_need(*, weight_bytes: int, kv_bytes_per_token: int, max_context: int, engine_args: dict,
                gpu_type: str, gpu_count: int, backend: str) -> MemoryNeed:
    sequences = int(engine_args.get("max_num_seqs") or DEFAULT_SEQUENCES)
    context = int(engine_args.get("max_model_len") or max_context)
    utilization = float(engine_args.get("gpu_memory_utilization", DEFAULT_MEMORY_UTILIZATION.get(backend, 1.0)))
    available = int(GPU_MEMORY_BYTES[gpu_type] * gpu_count * utilization)
    return MemoryNeed(weight_bytes=weight_bytes, kv_bytes=kv_bytes_per_token * sequences * context,
                      sequences=sequences, context=context, available_bytes=available)


def check(*, version, backend: str, engine_args: dict, resources: dict) -> dict[str, list[str]]:
    """DRF-style errors ({field: [reason]}) for a GPU deployment of version; {} when it fits."""
    gpu_count = resources.get("gpu_count") or 0
    if backend == "builtin" and (builtin := builtin_device_error(engine_args, gpu_count)):
        return {"engine_args": [builtin]}
    if gpu_count < 1:
        return {}
    errors: dict[str, list[str]] = {}
    if backend == "vllm":
        tensor = engine_args.get("tensor_parallel_size", 1)
        pipeline = engine_args.get("pipeline_parallel_size", 1)
        if tensor * pipeline != gpu_count:
            pp = f" x pipeline_parallel_size ({pipeline})" if pipeline != 1 else ""
            errors["engine_args"] = [f"tensor_parallel_size ({tensor}){pp} must equal resources.gpu_count "
                                     f"({gpu_count}): each replica uses exactly the GPUs it is given"]
    gpu_type = known_type(resources.get("gpu_type") or "")
    if gpu_type:
        need = memory_need(weight_bytes=version.weight_bytes, kv_bytes_per_token=version.kv_cache_bytes_per_token,
                           max_context=version.max_context, engine_args=engine_args, gpu_type=gpu_type,
                           gpu_count=gpu_count, backend=backend)
        if not need.fits:
            utilization = engine_args.get("gpu_memory_utilization", DEFAULT_MEMORY_UTILIZATION.get(backend, 1.0))
            errors["resources"] = [f"{version} does not fit: " + need.explain(gpu_type, gpu_count, utilization)]
    return errors


def builtin_device_error(engine_args: dict, gpu_count: int) -> str | None:
    """The built-in engine runs on the CPU or on one GPU: with resources.gpu_count 1 it runs on that
    GPU unless engine_args.device says otherwise (ReplicaSpec.run_args). A GPU it is given but does
    not use would sit idle, and one it uses must be given to it (a replica sees only its own)."""
    device = str(engine_args.get("device") or ("cuda" if gpu_count else "cpu"))
    if gpu_count > 1:
        return (f"the built-in engine runs on one GPU, not resources.gpu_count {gpu_count}: ask for 1, or use "
                "the vllm backend with tensor_parallel_size for several")
    if device.startswith("cuda") and gpu_count != 1:
        return (f"device {device} needs resources.gpu_count 1: a replica sees only the GPUs it is given")
    if device == "cpu" and gpu_count:
        return ("device cpu with resources.gpu_count 1 would leave the GPU idle: leave device out (the engine "
                "then runs on the GPU) or set gpu_count to 0")
    return None


def peak_flops(gpu_type: str) -> float | None:
    """Peak dense BF16 FLOP/s of one device of gpu_type, None when the table does not know it."""
    name = known_type(gpu_type)
    return PEAK_DENSE_BF16_TFLOPS[name] * 1e12 if name in PEAK_DENSE_BF16_TFLOPS else None


def parameters(version) -> tuple[int | None, str]:
    """The version's parameter count and how it is known: the registry's count (read from the
    checkpoint's tensors), else its weight bytes over its dtype's bytes per parameter."""
    if version.parameter_count and version.parameter_count > 0:
        return version.parameter_count, "the registry's parameter count"
    size = DTYPE_BYTES.get(version.dtype)
    if size and version.weight_bytes and version.weight_bytes > 0:
        return version.weight_bytes // size, f"weight bytes / {size} bytes per {version.dtype} parameter"
    return None, f"{version} records neither a parameter count nor weight bytes of a known dtype"
