"""Facts about an HF-format checkpoint, read without loading its weights.

Everything here reads config.json, the JSON headers of the safetensors files and the
tokenizer files. Weights are only streamed through sha256 for the digest, in bounded memory.
No Django: the serving runtime may use it too.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

GENERATE_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
EMBED_ARCHITECTURES = {"BertModel", "BertForMaskedLM"}
SUPPORTED_ARCHITECTURES = GENERATE_ARCHITECTURES | EMBED_ARCHITECTURES

# safetensors dtype codes -> (name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
DTYPE_BYTES = {name: size for name, size in SAFETENSORS_DTYPES.values()}
# A header this large is not a real checkpoint's; refuse it instead of reading it into memory.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DIGEST_CHUNK_BYTES = 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be registered; `field` names the request field at fault."""

    def __init__(self, message: str, field: str = "artifact_uri"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class CheckpointFacts:
    architecture: str
    parameter_count: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: str
    weight_bytes: int
    kv_cache_bytes_per_token: int
    has_tokenizer: bool
    has_chat_template: bool

    def as_dict(self) -> dict:
        return asdict(self)


def artifact_path(artifact_uri: str) -> Path:
    """A local directory from a path or a file:// URI; other schemes are refused clearly."""
    if not artifact_uri or not artifact_uri.strip():
        raise CheckpointError("artifact_uri is empty; give a local directory or a file:// URI.")
    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise CheckpointError(
                f"file:// URI with host {parsed.netloc!r} is not local; use file:///absolute/path."
            )
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(artifact_uri)
    else:
        raise CheckpointError(
            f"artifact_uri scheme {parsed.scheme}:// cannot be validated by this control plane; "
            "copy the checkpoint to a directory the workers can read and register that path "
            "or its file:// URI."
        )
    if not path.is_absolute():
        raise CheckpointError(f"artifact_uri {artifact_uri!r} must be an absolute path.")
    if not path.exists():
        raise CheckpointError(f"artifact_uri {artifact_uri!r}: no such directory.")
    if not path.is_dir():
        raise CheckpointError(f"artifact_uri {artifact_uri!r} is a file; give the checkpoint's directory.")
    return path


def read_config(root: Path) -> dict:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{root} has no config.json; is it an HF-format checkpoint?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError("config.json must hold a JSON object.")
    return config


def read_safetensors_header(path: Path) -> dict:
    """The tensor table of one safetensors file, checked against the file's real size."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path.name}: truncated safetensors file ({size} bytes).")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or header_len > size - 8:
            raise CheckpointError(
                f"{path.name}: safetensors header claims {header_len} bytes but the file has "
                f"{size}; the file is truncated or not safetensors."
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path.name}: unreadable safetensors header (not JSON).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object.")
    data_size = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: tensor {name!r} has a malformed entry.") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}.")
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]
        if not (0 <= start <= end <= data_size) or end - start != expected:
            raise CheckpointError(
                f"{path.name}: tensor {name!r} lies outside the file's data "
                f"({start}..{end} of {data_size} bytes); the file is truncated or corrupt."
            )
    return header


def _tensor_stats(root: Path) -> tuple[int, int, str]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors weights.")
    params = 0
    weight_bytes = 0
    dtype_bytes: Counter[str] = Counter()
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            count = math.prod(entry["shape"])
            start, end = entry["data_offsets"]
            params += count
            weight_bytes += end - start
            dtype_bytes[SAFETENSORS_DTYPES[entry["dtype"]][0]] += end - start
    dominant = dtype_bytes.most_common(1)[0][0] if dtype_bytes else "float32"
    return params, weight_bytes, dominant


def _config_int(config: dict, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"config.json: {key} must be a non-negative integer.")
            return value
    if default is None:
        raise CheckpointError(f"config.json: missing {keys[0]}.")
    return default


def _has_chat_template(root: Path) -> bool:
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return False
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("chat_template"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise CheckpointError("tokenizer_config.json is not valid JSON.") from None


def read_facts(root: Path, task: str | None = None) -> CheckpointFacts:
    config = read_config(root)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise CheckpointError("config.json: `architectures` is missing; cannot tell the model type.")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        )
    if task == "generate" and architecture not in GENERATE_ARCHITECTURES:
        raise CheckpointError(
            f"{architecture} is an encoder; register it under a model with task 'embed'."
        )
    if task == "embed" and architecture not in EMBED_ARCHITECTURES:
        raise CheckpointError(
            f"{architecture} generates text; register it under a model with task 'generate'."
        )

    hidden = _config_int(config, "hidden_size", "d_model")
    layers = _config_int(config, "num_hidden_layers", "n_layer")
    heads = _config_int(config, "num_attention_heads", "n_head")
    if heads == 0 or hidden % heads:
        raise CheckpointError("config.json: hidden_size must be a multiple of num_attention_heads.")
    kv_heads = _config_int(config, "num_key_value_heads", default=heads)
    head_dim = _config_int(config, "head_dim", default=hidden // heads)
    params, weight_bytes, weight_dtype = _tensor_stats(root)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or weight_dtype)
    if dtype not in DTYPE_BYTES:
        dtype = weight_dtype
    is_decoder = architecture in GENERATE_ARCHITECTURES
    return CheckpointFacts(
        architecture=architecture,
        parameter_count=params,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_config_int(config, "vocab_size"),
        max_context=_config_int(config, "max_position_embeddings", "n_positions", default=0),
        dtype=dtype,
        weight_bytes=weight_bytes,
        # Keys and values, per layer, per KV head: what one token costs in the paged cache.
        kv_cache_bytes_per_token=(
            2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype] if is_decoder else 0
        ),
        has_tokenizer=(root / "tokenizer.json").is_file() or (root / "vocab.txt").is_file(),
        has_chat_template=_has_chat_template(root),
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def artifact_manifest(root: Path) -> list[dict]:
    """Every regular file under root, sorted by relative POSIX path, with size and sha256."""
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        entries.append({"path": relative, "size": path.stat().st_size, "sha256": file_sha256(path)})
    entries.sort(key=lambda entry: entry["path"])
    return entries


def manifest_digest(manifest: list[dict]) -> str:
    """sha256 over `path<TAB>size<TAB>sha256<LF>` lines: renaming, resizing or editing any file
    changes it, and it does not depend on the order the filesystem lists files in."""
    digest = hashlib.sha256()
    for entry in manifest:
        digest.update(f"{entry['path']}\t{entry['size']}\t{entry['sha256']}\n".encode())
    return digest.hexdigest()
