"""LiteLLM custom auth for the overhead benchmark: virtual keys with rpm/tpm limits, no database.

LiteLLM's own virtual keys (`/key/generate`) need its Postgres schema, which it creates with
Prisma; Prisma fetches its query engine from a host this machine cannot reach. LiteLLM's
documented alternative is `general_settings.custom_auth`: a function that maps the bearer key
to a `UserAPIKeyAuth`, whose `rpm_limit` / `tpm_limit` / `max_parallel_requests` LiteLLM's
rate limiter then enforces (docs: proxy/custom_auth, "Key rate limits ... set on the returned
object, no flags required"). So LiteLLM checks a key and counts rpm/tpm on every request, as
the inferops gateway does.

Keys come from the JSON file named by $LITELLM_BENCH_KEYS, written by overhead_bench.py:
`{"<sha256 of the key>": {"rpm": int, "tpm": int, "max_parallel_requests": int,
"models": [names]}}`. Only hashes are stored, like the gateway's `inferops:keys`.
"""

from __future__ import annotations

import hashlib
import json
import os

from fastapi import Request
from litellm.proxy._types import ProxyException, UserAPIKeyAuth

with open(os.environ["LITELLM_BENCH_KEYS"], encoding="utf-8") as keys_file:
    KEYS: dict[str, dict] = json.load(keys_file)


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    entry = KEYS.get(hashlib.sha256(api_key.encode()).hexdigest())
    if entry is None:
        raise ProxyException(message="Invalid API key.", type="auth_error", param="api_key", code=401)
    return UserAPIKeyAuth(api_key=api_key, rpm_limit=entry["rpm"], tpm_limit=entry["tpm"],
                          max_parallel_requests=entry["max_parallel_requests"], models=entry["models"])
