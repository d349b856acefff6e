"""`inferops serve` on the command line: its options, the settings and backend they make, and
the process that serves them until a signal drains it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from runtime.engine.async_engine import AsyncEmbedder, AsyncEngine
from runtime.engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    OPS_BACKENDS,
    GenerationDefaults,
    parse_device,
)
from runtime.engine.metrics import DEFAULT_BUCKETS
from runtime.engine.server.draining import DrainingServer
from runtime.engine.server.routes import ReplicaServer
from runtime.engine.server.settings import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_TARGET_MS,
    FaultSettings,
    ServerSettings,
    SloTargetSettings,
)
from runtime.engine.slo_scheduling import POLICIES, SloTargets
from runtime.gateway import jsonlog
from runtime.gateway.http_protocol import DEFAULT_READ_TIMEOUT_S, protocol_class

if TYPE_CHECKING:  # both import torch, which loads in the model thread
    from runtime.engine.encoder import EmbeddingModel
    from runtime.engine.engine import LLMEngine

logger = logging.getLogger("inferops.serve")


def is_encoder_checkpoint(model_dir: str | Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the loader reports a missing or broken config with a better message
    architectures = config.get("architectures") or []
    return config.get("model_type") == "bert" or any(
        str(a).startswith("Bert") for a in architectures)


def _limit_cpu_threads(num_threads: int | None) -> None:
    """Called in the model thread, which runs every forward pass: OpenMP's thread count is a
    per-calling-thread setting."""
    if num_threads:
        import torch
        torch.set_num_threads(num_threads)


def build_backend(args: argparse.Namespace) -> AsyncEngine | AsyncEmbedder:
    """The model is loaded later, in the backend's thread, so the server can bind first."""
    if is_encoder_checkpoint(args.model):
        if args.device != "cpu":
            logger.warning("embedding models run on the CPU here: --device %s applies to generative "
                           "checkpoints only", args.device)

        def load_encoder() -> EmbeddingModel:
            from runtime.engine.encoder import EmbeddingModel
            _limit_cpu_threads(args.cpu_threads)
            # Encoders are small; "auto" keeps them in float32 for exact vectors on CPU.
            return EmbeddingModel.load(args.model,
                                       "float32" if args.dtype == "auto" else args.dtype)
        return AsyncEmbedder(load_encoder)

    def load_engine() -> LLMEngine:
        from runtime.engine.config import EngineConfig
        from runtime.engine.engine import LLMEngine
        _limit_cpu_threads(args.cpu_threads)
        return LLMEngine(EngineConfig(
            model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
            background_priority=None if args.no_background_priority else args.background_priority,
            background_tokens_per_step=args.background_tokens_per_step,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
            linear_backend=args.linear_backend, ops_backend=args.ops_backend,
            kv_cache_dtype=args.kv_cache_dtype, scheduling_policy=args.scheduling_policy,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            slo_reject_late=args.slo_reject_late, device=args.device,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager))
    return AsyncEngine(load_engine)


def _size_in_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper().rstrip("B")
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "KI": 1, "MI": 2, "GI": 3, "TI": 4}
    base = 1024 if unit.endswith("I") or unit == "" else 1000
    return int(number * base ** powers[unit])


def _buckets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of seconds: {text!r}") from None
    if not values or list(values) != sorted(set(values)) or values[0] <= 0:
        raise argparse.ArgumentTypeError("buckets must be positive and strictly increasing")
    return values


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _target_ms(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TARGET_MS:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {MAX_TARGET_MS} ms, got {text}")
    return value


def _device(text: str) -> str:
    try:
        parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _gpu_share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends a real default to the help text; None/False defaults say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        silent = action.default is None or action.default is False \
            or action.default == argparse.SUPPRESS
        if not silent and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelpFormatter
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8001, help="port to bind")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as `model` (default: the directory name)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (auto follows the checkpoint, but loads a bf16 "
                             "or fp16 one in float32 on a CPU without native matmuls in that "
                             "dtype); with bfloat16 and the compiled kernels, activations "
                             "stay float32 and only the matmuls run in bf16")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="what the KV cache stores (auto: the weights' dtype, as vLLM); "
                             "bfloat16 holds twice the tokens of float32 in the same memory")
    engine.add_argument("--max-num-seqs", type=int, default=64,
                        help="most sequences in one batch")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="token budget of one step (prefill chunks plus decodes)")
    engine.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                        help="prefill tokens a step may add while decodes run (default: the "
                             "whole --max-num-batched-tokens); lower trades TTFT for TPOT")
    engine.add_argument("--background-priority", type=int, default=-1000,
                        help="requests at or below this priority are background work (eval runs ask for "
                             "-1000): they share --background-tokens-per-step while others run or wait")
    engine.add_argument("--background-tokens-per-step", type=int, default=16,
                        help="tokens of a step background requests may take while foreground ones run (16)")
    engine.add_argument("--no-background-priority", action="store_true",
                        help="no background class: every priority competes for the whole step")
    engine.add_argument("--scheduling-policy", default="priority", choices=POLICIES,
                        help="priority: higher priority first, then first come first served; fcfs: arrival "
                             "order only (vLLM's default); slo: plan each step for the requests' TTFT and "
                             "TPOT targets, least slack first, late requests last (docs/serving.md)")
    engine.add_argument("--slo-ttft-ms", type=_target_ms, default=2000.0,
                        help="TTFT target of requests that bring none and get none from the control plane")
    engine.add_argument("--slo-tpot-ms", type=_target_ms, default=200.0,
                        help="TPOT target of requests that bring none and get none from the control plane")
    engine.add_argument("--slo-reject-late", action="store_true",
                        help="with --scheduling-policy slo: refuse a request that can no longer meet its TTFT "
                             "target with a 503 and Retry-After instead of serving it late (a stream's "
                             "headers then wait for its first token)")
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV cache size in blocks (overrides --kv-cache-memory)")
    engine.add_argument("--kv-cache-memory", type=_size_in_bytes, default=None,
                        help="KV cache size, e.g. 512MiB (default: the engine's)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the checkpoint's)")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse KV blocks of shared prompt prefixes")
    engine.add_argument("--no-generation-config", action="store_true",
                        help="ignore the checkpoint's generation_config.json: requests that "
                             "leave out temperature, top_p, top_k, min_p or repetition_penalty "
                             "get OpenAI's defaults")
    engine.add_argument("--seed", type=int, default=0,
                        help="seed for requests that bring none")
    engine.add_argument("--cpu-threads", type=int, default=None,
                        help="torch intra-op threads for the forward pass (default: torch's, "
                             "one per core); on a busy or small host, 1 avoids oversubscription")
    engine.add_argument("--device", type=_device, default="cpu",
                        help="where the model runs: cpu, or cuda / cuda:N (bf16 or fp16 weights, the "
                             "KV cache in GPU memory; a replica sees the GPUs its driver gave it)")
    engine.add_argument("--gpu-memory-utilization", type=_gpu_share,
                        default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help="with --device cuda: the share of the GPU's memory the engine may fill; the "
                             "KV cache gets what the weights and a step's activations leave")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="with --device cuda: launch every decode step's kernels from Python instead "
                             "of replaying CUDA graphs captured at start-up (slower; saves their capture "
                             "time and memory)")
    engine.add_argument("--linear-backend", default="auto", choices=LINEAR_BACKENDS,
                        help="weight matmuls: onednn packs weights once (2-3x faster on CPU), "
                             "torch uses F.linear, auto picks oneDNN where this CPU supports it")
    engine.add_argument("--ops-backend", default="auto", choices=OPS_BACKENDS,
                        help="attention and element-wise ops: kernels are compiled C (built on "
                             "first use with the machine's C compiler; float32; attention reads "
                             "KV blocks in place), torch uses torch ops and gathers KV blocks "
                             "for SDPA, auto uses the kernels where they build")
    server = parser.add_argument_group("server")
    server.add_argument("--max-body-bytes", type=_size_in_bytes, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (larger ones get 413)")
    server.add_argument("--request-read-timeout", type=_positive, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a client has to send a whole request, headers and body, from "
                             "connecting or from the request's first byte; later it gets a 408 and the "
                             "connection is closed (slow clients and slow-loris attacks)")
    server.add_argument("--drain-timeout", type=_non_negative, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests")
    server.add_argument("--admin-token", default=None,
                        help="bearer token for /admin/* (default: $INFEROPS_ADMIN_TOKEN, "
                             "which keeps it out of `ps`; without one the admin API is off)")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="log level")
    for key, default in DEFAULT_BUCKETS.items():
        server.add_argument(f"--histogram-buckets-{key}", type=_buckets, default=None,
                            metavar="S1,S2,...",
                            help=f"{key} histogram bucket edges in seconds "
                                 f"(default: vLLM's, {default[0]}..{default[-1]})")
    faults = parser.add_argument_group("fault injection (tests and game days; off by default)")
    faults.add_argument("--fault-ttft-ms", type=_non_negative, default=0.0,
                        help="extra delay before each request's first token")
    faults.add_argument("--fault-tpot-ms", type=_non_negative, default=0.0,
                        help="extra delay per output token after the first")
    faults.add_argument("--fault-error-rate", type=_fraction, default=0.0,
                        help="fraction of requests answered with a 500")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    model_root = str(Path(args.model).resolve())
    return ServerSettings(
        served_model_name=args.served_model_name or Path(model_root).name,
        model_root=model_root,
        max_body_bytes=args.max_body_bytes,
        admin_token=args.admin_token or os.environ.get("INFEROPS_ADMIN_TOKEN") or None,
        faults=FaultSettings(args.fault_ttft_ms, args.fault_tpot_ms, args.fault_error_rate),
        histogram_buckets={key: getattr(args, f"histogram_buckets_{key}")
                           for key in DEFAULT_BUCKETS
                           if getattr(args, f"histogram_buckets_{key}") is not None},
        generation_defaults=GenerationDefaults() if args.no_generation_config
        else GenerationDefaults.from_dir(model_root),
        slo_targets=SloTargetSettings(SloTargets.from_ms(args.slo_ttft_ms, args.slo_tpot_ms)),
        scheduling_policy=args.scheduling_policy,
        slo_reject_late=args.slo_reject_late and args.scheduling_policy == "slo",
    )


def main(args: argparse.Namespace) -> int:
    json_lines = jsonlog.configure(args.log_level)
    if not Path(args.model, "config.json").is_file():
        logger.error("no config.json in %s", args.model)
        return 2
    try:
        settings = settings_from_args(args)
    except ValueError as error:  # an unusable generation_config.json
        logger.error("%s; fix it or start with --no-generation-config", error)
        return 2
    if args.slo_reject_late and args.scheduling_policy != "slo":
        logger.warning("--slo-reject-late applies only with --scheduling-policy slo; it is ignored under %s",
                       args.scheduling_policy)
    defaults = settings.generation_defaults
    if replace(defaults, ignored=()) != GenerationDefaults():  # any value applies
        logger.info("requests that leave them out get the checkpoint's generation_config.json "
                    "defaults: temperature=%s top_p=%s top_k=%s min_p=%s repetition_penalty=%s "
                    "(--no-generation-config: OpenAI's)", defaults.temperature, defaults.top_p,
                    defaults.top_k, defaults.min_p, defaults.repetition_penalty)
    if defaults.ignored:
        logger.warning("generation_config.json sets %s, which this runtime does not apply",
                       ", ".join(defaults.ignored))
    replica = ReplicaServer(build_backend(args), settings)
    config = uvicorn.Config(replica.build_app(), host=args.host, port=args.port,
                            http=protocol_class(args.request_read_timeout),
                            log_level=args.log_level, lifespan="on",
                            log_config=None if json_lines else uvicorn.config.LOGGING_CONFIG,
                            # Our own drain waited already; what is left after it is cut.
                            timeout_graceful_shutdown=1, timeout_keep_alive=5)
    server = DrainingServer(config, replica, args.drain_timeout)
    logger.info("serving %s as %r on http://%s:%d (loading in the background)",
                settings.model_root, settings.served_model_name, args.host, args.port)
    server.run()
    return server.exit_code
