"""Weights straight from a checkpoint's safetensors files (single or sharded), no transformers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    requested: str,
    checkpoint_dtype: str,
    runs_natively: Callable[[torch.dtype], bool],
) -> torch.dtype:
    """`auto` follows the checkpoint's dtype (float32 when it names none we know), except that
    a half-precision checkpoint loads in float32 where this CPU cannot multiply in its dtype
    natively (`runs_natively`, e.g. oneDNN without AVX-512 or AVX-NE-CONVERT). There the
    matmuls fall back to emulated half precision: small's engine did 14 output tok/s in bf16
    against 112 in float32 on an AVX2 Zen 3 (bench/README.md, tenth round). An explicit dtype
    is kept."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    name = checkpoint_dtype.removeprefix("torch.")
    dtype = TORCH_DTYPES.get(name, torch.float32)
    if dtype != torch.float32 and not runs_natively(dtype):
        logger.warning(
            "the checkpoint is %s, but this CPU has no native %s matmul; loading it in float32 "
            "(several times faster here, twice the weight memory). Pass --dtype %s to keep it.",
            name, name, name,
        )
        return torch.float32
    return dtype


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in shard_names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(
            f"no complete safetensors weights in {model_dir} (missing {missing})"
        )
    return files


def load_state_dict(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, tensor in load_file(str(path)).items():
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
