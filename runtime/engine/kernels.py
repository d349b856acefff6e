"""Compiled CPU kernels: C sources in csrc/, built on first use, called through ctypes.

Why not a torch C++ extension: compiling against torch's headers takes about a minute on a
2-core machine and needs ninja; a plain C file builds in about a second with the C compiler
every Linux machine with build tools has. ctypes releases the GIL for the call, and the
kernel's OpenMP threads come from the libgomp that torch loaded (same soname), so it shares
torch's thread pool instead of starting a second one.

All of csrc/*.c build into one library, cached under $INFEROPS_KERNEL_CACHE (default
~/.cache/inferops/kernels) and keyed by the sources, the compiler, the flags and the CPU
(`-march=native`), so a cache copied to another machine is never used there. The C code picks
its vector paths from the flags the compiler targets: AVX-512, else AVX2 with FMA, else
portable loops. The engine builds for this CPU (CFLAGS); PORTABLE_CFLAGS build the loops
alone, which the tests check too. Without a compiler, or when the build fails, `load()`
raises KernelUnavailableError and the engine keeps its pure-torch path
(EngineConfig.ops_backend "auto").
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIBRARY = "inferops_kernels"
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
CFLAGS = ("-march=native", *_COMMON_CFLAGS)
# The baseline x86-64 (SSE2 only): no AVX2 or AVX-512 code, whatever the compiler's default.
PORTABLE_CFLAGS = (*(("-march=x86-64",) if platform.machine() == "x86_64" else ()),
                   *_COMMON_CFLAGS)
# libmvec: glibc's vector math (expf 8 at a time), x86-64 only (see csrc/paged_attention.c).
LIBS = ("-lmvec", "-lm") if platform.machine() == "x86_64" else ("-lm",)


class KernelUnavailableError(RuntimeError):
    """A kernel could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    configured = os.environ.get("INFEROPS_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferops" / "kernels"


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in seen:
            seen[key] = value.strip()
    return platform.machine() + "|" + "|".join(f"{k}={v}" for k, v in sorted(seen.items()))


def find_compiler() -> str:
    """$CC, else cc, else gcc."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailableError("no C compiler (cc or gcc; install gcc, or set CC)")
    return compiler


def _build(cflags: tuple[str, ...]) -> Path:
    compiler = find_compiler()
    sources = sorted(SOURCE_DIR.glob("*.c"))
    headers = sorted(SOURCE_DIR.glob("*.h"))
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailableError(f"C compiler {compiler} does not run: {error}") from error
    key = hashlib.sha256("\0".join(
        [*(path.read_text() for path in sources + headers), compiler, version, *cflags, *LIBS,
         _cpu_signature()]
    ).encode()).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"{LIBRARY}-{key}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: a concurrent builder (another
        # replica starting) never loads a half-written file.
        handle, scratch = tempfile.mkstemp(prefix=f".{LIBRARY}-", suffix=".so", dir=directory)
    except OSError as error:  # a read-only home, say: run without the kernels, not crash
        raise KernelUnavailableError(
            f"cannot write the kernel cache {directory} ({error}); set INFEROPS_KERNEL_CACHE"
        ) from error
    os.close(handle)
    try:
        try:
            result = subprocess.run(
                [compiler, *cflags, "-o", scratch, *map(str, sources), *LIBS],
                capture_output=True, text=True, timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelUnavailableError(f"building with {compiler} failed: {error}") from error
        if result.returncode != 0:
            raise KernelUnavailableError(
                f"building {SOURCE_DIR} with {compiler} failed: {result.stderr.strip()[-2000:]}"
            )
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    logger.info("built CPU kernels into %s", target)
    return target


@cache
def load(cflags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL:
    """The library of every csrc/*.c built with `cflags`, built now unless cached. Raises
    KernelUnavailableError when it cannot be built or loaded."""
    path = _build(cflags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailableError(f"cannot load {path}: {error}") from error


def unavailable_reason(cflags: tuple[str, ...] = CFLAGS) -> str | None:
    """None where the build for `cflags` loads here; else why not, for a test's skip."""
    try:
        load(cflags)
    except KernelUnavailableError as error:
        return f"{error}: the kernels' torch fallback runs instead"
    return None


_POINTER, _SIZE, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name: argument types; every function returns int (0, or negative for an error).
_SIGNATURES = {
    "paged_attention_f32": [_POINTER, _POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _SIZE, _SIZE,
                            _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _FLOAT, _POINTER, _INT, _INT],
    "paged_prefill_attention_f32": [_POINTER, _POINTER, _POINTER, _SIZE, _POINTER, _SIZE, _SIZE,
                                    _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _FLOAT, _POINTER,
                                    _INT, _INT],
    "add_rms_norm_f32": [_POINTER, _POINTER, _POINTER, _FLOAT, _POINTER, _SIZE, _SIZE, _INT],
    "rope_store_kv_f32": [_POINTER, _POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE, _SIZE,
                          _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT],
    "silu_mul_f32": [_POINTER, _POINTER, _SIZE, _SIZE, _INT],
}
OUT_OF_BOUNDS, NO_MEMORY = -2, -1


_KV_DTYPES = (torch.float32, torch.bfloat16)


def _float32(*tensors: torch.Tensor) -> None:
    # The C code trusts its pointers: everything it reads or writes must be contiguous fp32.
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        raise ValueError("CPU kernels need contiguous float32 tensors")


def _kv_bf16(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """1 for a bf16 KV cache, 0 for float32 (the C code's flag); both contiguous, one dtype."""
    if (k_cache.dtype not in _KV_DTYPES or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError("CPU kernels need contiguous float32 or bfloat16 KV caches of one dtype")
    return int(k_cache.dtype == torch.bfloat16)


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor) -> int:
    """Refuses what the attention kernels cannot read; 1 for a bf16 cache, 0 for float32."""
    _float32(q, out)
    kv_bf16 = _kv_bf16(k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    _, _, kv_heads, cache_head_dim = k_cache.shape
    if (cache_head_dim != head_dim or v_cache.shape != k_cache.shape or out.shape != q.shape
            or num_heads % kv_heads):
        raise ValueError("paged attention kernel got mismatched shapes")
    return kv_bf16


def _attention_result(out: torch.Tensor, status: int) -> torch.Tensor:
    if status == OUT_OF_BOUNDS:
        raise ValueError("a context length is longer than its block table, or a block "
                         "table names a block outside the cache")
    if status == NO_MEMORY:
        raise MemoryError("paged attention kernel could not allocate its scratch memory")
    return out


def _attention_call(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    kv_bf16: bool, window: int | None, *tables) -> torch.Tensor:
    """Run a paged attention kernel: q's and the caches' data, the kernel's own `tables` (which blocks,
    which rows), then the shapes, window, scale, output and threads both kernels take in that order."""
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    return _attention_result(out, kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], *tables,
        num_heads, kv_heads, head_dim, block_size, window or 0, head_dim**-0.5, out.data_ptr(), kv_bf16,
        torch.get_num_threads(),
    ))


class CpuKernels:
    """The compiled kernels of csrc/, each checking the shapes it is given before the call.

    Block ids, context lengths and cache slots are checked by the C code itself (cheaper than
    torch reductions on every call) and refused with a ValueError instead of a crash.
    """

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """`library`: another build of csrc/ (a benchmark's baseline); default, this one's."""
        library = library or load()
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name, None)
            if function is None:  # an older build (a benchmark's baseline) lacks it
                continue
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            setattr(self, f"_{name}", function)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """out[r] = row r's attention over key positions [max(0, len - window), len) of its
        block table (csrc/paged_attention.c): q, out [rows, heads, head_dim] float32, caches
        [blocks, block_size, kv_heads, head_dim] float32 or bf16, block_tables [rows, width]
        and context_lens [rows] int32."""
        rows = q.shape[0]
        kv_bf16 = _check_attention(q, k_cache, v_cache, out)
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("block_tables and context_lens must be int32")
        if (block_tables.shape[0] != rows or context_lens.shape != (rows,)
                or not block_tables.is_contiguous()):
            raise ValueError("paged attention kernel got mismatched shapes")
        if rows == 0:
            return out
        return _attention_call(self._paged_attention_f32, q, k_cache, v_cache, out, kv_bf16, window,
                               block_tables.data_ptr(), context_lens.data_ptr(), rows, block_tables.shape[1])

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start: int,
        out: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """A prefill chunk of one sequence whose keys and values are already in their slots:
        out[i] = the attention of position start + i over positions [0, start + i] (the last
        `window` of them) of `block_table` ([width] int32); q, out and caches as for
        paged_attention. Rows go in tiles that read each block once, multiplied as small
        matrices where the head_dim fits the CPU's vectors (csrc/paged_attention.c)."""
        rows = q.shape[0]
        kv_bf16 = _check_attention(q, k_cache, v_cache, out)
        if block_table.dtype != torch.int32 or block_table.dim() != 1 \
                or not block_table.is_contiguous():
            raise ValueError("block_table must be one contiguous row of int32")
        if rows == 0:
            return out
        return _attention_call(self._paged_prefill_attention_f32, q, k_cache, v_cache, out, kv_bf16, window,
                               block_table.data_ptr(), block_table.shape[0], start, rows)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden += delta (in place, unless delta is None); returns RMSNorm(hidden) * weight."""
        rows, width = hidden.shape
        _float32(hidden, weight, *([delta] if delta is not None else []))
        if weight.shape != (width,) or (delta is not None and delta.shape != hidden.shape):
            raise ValueError("add_rms_norm got mismatched shapes")
        out = torch.empty_like(hidden)
        self._add_rms_norm_f32(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                               weight.data_ptr(), eps, out.data_ptr(), rows, width,
                               torch.get_num_threads())
        return out

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary embedding on the q and k of each qkv row ([q | k | v]), with cos/sin
        [rows, head_dim] for the rows' positions; the rotated key and the value go to cache
        slot `slots[r]` (int64), rounded to bf16 in a bf16 cache. Returns q, k
        [rows, heads, head_dim] and v (a view of qkv), float32."""
        rows = qkv.shape[0]
        _, block_size, kv_heads, head_dim = k_cache.shape
        _float32(qkv, cos, sin)
        kv_bf16 = _kv_bf16(k_cache, v_cache)
        q_width, kv_width = num_heads * head_dim, kv_heads * head_dim
        if (qkv.shape[1] != q_width + 2 * kv_width or cos.shape != (rows, head_dim)
                or sin.shape != cos.shape or v_cache.shape != k_cache.shape
                or slots.dtype != torch.int64 or slots.shape != (rows,)
                or not slots.is_contiguous() or head_dim % 2):
            raise ValueError("rope_store_kv got mismatched shapes")
        q = torch.empty(rows, num_heads, head_dim)
        k = torch.empty(rows, kv_heads, head_dim)
        status = self._rope_store_kv_f32(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            k_cache.shape[0] * block_size, rows, num_heads, kv_heads, head_dim, q.data_ptr(),
            k.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_bf16,
            torch.get_num_threads(),
        )
        if status == OUT_OF_BOUNDS:
            raise ValueError("a cache slot is outside the cache")
        v = qkv[:, q_width + kv_width :].view(rows, kv_heads, head_dim)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows of [gate | up]."""
        rows, width = gate_up.shape
        _float32(gate_up)
        if width % 2:
            raise ValueError("silu_mul needs rows of [gate | up], an even width")
        out = torch.empty(rows, width // 2)
        self._silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                           torch.get_num_threads())
        return out


@cache
def cpu_kernels() -> CpuKernels:
    """The kernels, built and loaded once per process; raises KernelUnavailableError."""
    return CpuKernels()
