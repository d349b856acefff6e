"""Engine options (`EngineConfig`) and the model facts read from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DEFAULT_KV_CACHE_MEMORY = 512 * 1024 * 1024
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What each "auto" and the dtypes become on this machine: plan.resolve_plan.
LINEAR_BACKENDS = ("auto", "onednn", "torch")
OPS_BACKENDS = ("auto", "kernels", "torch")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# vLLM's default share of a GPU's memory that the engine may take (weights, activations, KV cache).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def parse_device(device: str) -> tuple[str, int | None]:
    """("cpu", None), ("cuda", None) or ("cuda", N) for "cpu", "cuda", "cuda:N"; ValueError else."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return "cpu", None
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index) if index else None
    raise ValueError(f"device must be cpu, cuda or cuda:N, not {device!r}")


@dataclass
class EngineConfig:
    """What the engine is asked for; plan.ExecutionPlan is what that comes to here."""

    model: str  # checkpoint directory
    served_model_name: str | None = None
    # The weights': auto | float32 | bfloat16 | float16 (auto: the checkpoint's, or float32
    # where this CPU has no native matmul in it).
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    # bytes; when both this and num_kv_blocks are None: 512 MiB, capped at what
    # max_num_seqs sequences of max_model_len tokens could ever use.
    kv_cache_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Prefill tokens a step may carry while it also runs decodes (None: the whole budget).
    # Smaller keeps a long prompt from stretching every running stream's time per token.
    max_prefill_tokens_with_decodes: int | None = None
    # Requests at or below this priority are background work (None: none are); while foreground
    # requests run or wait, background ones share this many tokens a step (runtime/engine/scheduler.py).
    background_priority: int | None = -1000
    background_tokens_per_step: int = 16
    max_model_len: int | None = None  # default: config max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    # torch intra-op threads for the forward pass; None leaves torch's default (all cores).
    # On a busy machine fewer threads can be much faster: OpenMP workers that wait on each
    # other's time slices make small matmuls tens of times slower.
    num_threads: int | None = None
    # How the forward pass multiplies by its weights: "onednn" (weights packed once into
    # oneDNN's layout, 2-3x faster on CPU), "torch" (F.linear), "auto" (oneDNN where it can).
    linear_backend: str = "auto"
    # Attention and the element-wise work between matmuls (norms, rotary, SiLU, cache
    # writes): "kernels" (compiled C, runtime/engine/csrc; attention reads KV blocks in
    # place; float32 only), "torch" (gathers blocks for SDPA; torch ops), "auto" (the
    # kernels where they build). With bf16 weights and the kernels, activations stay float32.
    ops_backend: str = "auto"
    # What the KV cache stores: "auto" is the weights' dtype (as in vLLM), so a bf16 model
    # holds twice the tokens a float32 one does in the same memory; "float32" or "bfloat16"
    # force it (attention arithmetic is float32 with the kernels either way).
    kv_cache_dtype: str = "auto"
    # Where the model runs: "cpu" (the compiled C kernels and oneDNN), or "cuda" / "cuda:N"
    # (half-precision weights, torch's SDPA and a paged decode over the KV blocks in GPU memory):
    # plan.resolve_plan picks the back end from it.
    device: str = "cpu"
    # cuda: the share of the GPU's memory the engine may fill; the KV cache gets what the weights
    # and a profiled step's activations leave of it (unless num_kv_blocks / kv_cache_memory say).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # cuda: no CUDA graphs of decode steps (runtime/engine/cuda_graphs.py), as vLLM's flag says.
    enforce_eager: bool = False
    # How the queues are ordered (runtime/engine/scheduler.py): priority | fcfs | slo.
    scheduling_policy: str = "priority"
    # Targets of requests that bring none (the replica's own, or the control plane's, win).
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    # slo policy: refuse a request that can no longer meet its TTFT instead of serving it late.
    slo_reject_late: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPE_BYTES):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be auto, onednn or torch, not {self.linear_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto, float32 or bfloat16, not {self.kv_cache_dtype!r}"
            )
        if self.ops_backend not in OPS_BACKENDS:
            raise ValueError(
                f"ops_backend must be auto, kernels or torch, not {self.ops_backend!r}"
            )
        parse_device(self.device)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority", "slo"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or slo, not {self.scheduling_policy!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.background_tokens_per_step < 1:
            raise ValueError(f"background_tokens_per_step must be >= 1, got {self.background_tokens_per_step}")
        if self.max_prefill_tokens_with_decodes is not None and \
                self.max_prefill_tokens_with_decodes < 1:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 1, got "
                             f"{self.max_prefill_tokens_with_decodes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


# generation_config.json keys this runtime does not take from the file, with the value that
# means "off": vLLM does not take them either (requests can still set both).
UNSUPPORTED_GENERATION_KEYS = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
# The most alternatives a token's logprobs may list (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20
# OpenAI's bound on |presence_penalty| and |frequency_penalty|.
MAX_ADDITIVE_PENALTY = 2.0
# OpenAI's bound on a logit_bias value (-100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for what a request leaves out: OpenAI's, or those the checkpoint
    ships in generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty), as
    vLLM's default `--generation-config auto` does: Qwen2.5 ships 0.7 / 0.8 / 20 / - / 1.05,
    Qwen3 0.6 / 0.95 / 20 / 0, Llama 3 Instruct 0.6 / 0.9."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    # Keys the file sets to something other than "off" that this runtime cannot apply.
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """Raises ValueError naming the file and the key when a value is unusable."""
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} is not readable JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object")

        def number(key: str, default: float, valid, rule: str) -> float:
            value = raw.get(key, default)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
                raise ValueError(f"{path}: {key} must be {rule}, not {value!r}")
            return value

        top_k = number("top_k", 0, lambda v: float(v).is_integer() and v >= -1,
                       "an integer >= -1")
        return cls(
            temperature=float(number("temperature", 1.0, lambda v: v >= 0, ">= 0")),
            top_p=float(number("top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")),
            top_k=max(int(top_k), 0),  # -1 and 0 both mean off
            min_p=float(number("min_p", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]")),
            repetition_penalty=float(number("repetition_penalty", 1.0, lambda v: v > 0, "> 0")),
            ignored=tuple(key for key, off in UNSUPPORTED_GENERATION_KEYS.items()
                          if raw.get(key) not in (None, off)),
        )


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the forward pass needs, normalised across transformers versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"unsupported architectures {architectures}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        sliding_window = None
        # Qwen2 checkpoints ship sliding_window but only honour it with use_sliding_window.
        if architecture == "MistralForCausalLM" or (is_qwen2 and raw.get("use_sliding_window")):
            sliding_window = raw.get("sliding_window")
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_parse_rope(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            sliding_window=sliding_window,
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
        )


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints write
    # "rope_theta" plus an optional "rope_scaling" whose kind is "rope_type" or legacy "type".
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
