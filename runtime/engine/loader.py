"""Weights straight from a checkpoint's safetensors files (single or sharded), no transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_state_dict(model_dir: str | Path, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, floating-point ones in `dtype`, on `device`: a file's
    tensors are read to the CPU, one file at a time, and each is copied over as it is cast."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, tensor in load_file(str(path)).items():
            state[name] = (tensor.to(device=device, dtype=dtype) if tensor.is_floating_point()
                           else tensor.to(device))
    return state
