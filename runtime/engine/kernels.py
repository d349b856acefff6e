"""Compiled CPU kernels: C sources in csrc/, built on first use, called through ctypes.

Why not a torch C++ extension: compiling against torch's headers takes about a minute on a
2-core machine and needs ninja; a plain C file builds in about a second with the C compiler
every Linux machine with build tools has. ctypes releases the GIL for the call, and the
kernel's OpenMP threads come from the libgomp that torch loaded (same soname), so it shares
torch's thread pool instead of starting a second one.

All of csrc/*.c build into one library, cached under $INFEROPS_KERNEL_CACHE (default
~/.cache/inferops/kernels) and keyed by the sources, the compiler, the flags and the CPU
(`-march=native`), so a cache copied to another machine is never used there. Without a
compiler, or when the build fails, `load()` raises KernelUnavailableError and the engine
keeps its pure-torch path (EngineConfig.attention_backend "auto").
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
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
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


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailableError("no C compiler found (install gcc, or set CC)")
    sources = sorted(SOURCE_DIR.glob("*.c"))
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailableError(f"C compiler {compiler} does not run: {error}") from error
    key = hashlib.sha256("\0".join(
        [*(source.read_text() for source in sources), compiler, version, *CFLAGS, *LIBS,
         _cpu_signature()]
    ).encode()).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"{LIBRARY}-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: a concurrent builder (another replica
    # starting) never loads a half-written file.
    handle, scratch = tempfile.mkstemp(prefix=f".{LIBRARY}-", suffix=".so", dir=directory)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *CFLAGS, "-o", scratch, *map(str, sources), *LIBS],
                                capture_output=True, text=True, timeout=300)
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
def load() -> ctypes.CDLL:
    """The library of every csrc/*.c, built now unless cached. Raises KernelUnavailableError
    when it cannot be built or loaded."""
    path = _build()
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailableError(f"cannot load {path}: {error}") from error


def available() -> bool:
    try:
        load()
    except KernelUnavailableError:
        return False
    return True


class PagedAttention:
    """Decode (and any other row-by-row) attention that reads K/V from their cache blocks.

    `__call__` fills `out[r]` with row r's attention over key positions
    [max(0, len - window), len) of its block table (see csrc/paged_attention.c).
    """

    dtype = torch.float32

    def __init__(self) -> None:
        function = load().paged_attention_f32
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = [pointer, pointer, pointer, size, pointer, pointer, size, size, size,
                             size, size, size, size, ctypes.c_float, pointer, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        rows, num_heads, head_dim = q.shape
        _, block_size, kv_heads, cache_head_dim = k_cache.shape
        # The C code trusts its pointers: check the shapes here; it checks the block ids and
        # context lengths itself (cheaper than torch reductions on every call).
        if not all(t.dtype == self.dtype and t.is_contiguous() for t in (q, k_cache, v_cache, out)):
            raise ValueError("paged attention kernel needs contiguous float32 q, caches and out")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("block_tables and context_lens must be int32")
        if (cache_head_dim != head_dim or v_cache.shape != k_cache.shape or out.shape != q.shape
                or num_heads % kv_heads or block_tables.shape[0] != rows
                or context_lens.shape != (rows,) or not block_tables.is_contiguous()):
            raise ValueError("paged attention kernel got mismatched shapes")
        if rows == 0:
            return out
        status = self._function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
            block_tables.data_ptr(), context_lens.data_ptr(), rows, block_tables.shape[1],
            num_heads, kv_heads, head_dim, block_size, window or 0, head_dim**-0.5,
            out.data_ptr(), torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError("a context length is longer than its block table, or a block "
                             "table names a block outside the cache")
        if status != 0:
            raise MemoryError("paged attention kernel could not allocate its scratch memory")
        return out


@cache
def paged_attention() -> PagedAttention:
    return PagedAttention()
