#!/usr/bin/env bash
# LiteLLM's proxy in its OWN virtual environment (never the project's .venv), for the gateway
# overhead benchmark (bench/gateway/overhead_bench.py finds it at bench/gateway/.venv-litellm).
#
# Version: 1.106.12 is the newest LiteLLM whose `[proxy]` extra installs from the registry this
# project reaches (1.108+ pin litellm-proxy-extras releases that are not there, 1.110 needs a
# `litellm-proxy` package that is not there either). 1.107.x is skipped on purpose: it was the
# compromised release.
#
# No config is written here: overhead_bench.py writes it per run (it knows the upstream ports)
# into bench/gateway/work/overhead/litellm_config.yaml: two models pointing at the fast upstreams,
# and `general_settings.custom_auth: litellm_auth.user_api_key_auth`, a virtual key with
# rpm_limit / tpm_limit / max_parallel_requests (bench/gateway/litellm_auth.py says why custom
# auth and not LiteLLM's Postgres-backed keys: its Prisma engine cannot be downloaded here).
set -euo pipefail

LITELLM_VERSION="1.106.12"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-litellm"
PYTHON="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "litellm[proxy]==$LITELLM_VERSION"

# The custom auth module must import inside LiteLLM's venv (it reads the key file at import).
keys_file="$(mktemp)"
trap 'rm -f "$keys_file"' EXIT
echo '{}' > "$keys_file"
LITELLM_BENCH_KEYS="$keys_file" LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONPATH="$HERE" \
    "$VENV/bin/python" -c "import litellm_auth, importlib.metadata as m; print('litellm', m.version('litellm'))"
