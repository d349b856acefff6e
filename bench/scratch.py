"""A scratch database for the control-plane benchmarks: made fresh on the Postgres of
DATABASE_URL, Django set up on it, dropped when the benchmark is done; how they wait for the
processes they start, find them a port, log progress and read a percentile; a model version to deploy."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parents[1]


def scratch_database_url(url: str, name: str) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def recreate_scratch_database(admin_url: str, name: str, *, drop_only: bool = False) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        if not drop_only:
            conn.execute(f"CREATE DATABASE {name}")


def django_on_scratch_database(name: str) -> str:
    """Point Django at a fresh database `name` and set it up; returns the admin URL to drop it with."""
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url or not os.environ.get("REDIS_URL"):
        sys.exit("set DATABASE_URL and REDIS_URL (see the module docstring)")
    recreate_scratch_database(admin_url, name)
    os.environ["DATABASE_URL"] = scratch_database_url(admin_url, name)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    return admin_url


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - a process still starting answers with anything
            value = None
        if value:
            return value
        time.sleep(interval_s)
    raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the nearest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def bench_model_version():
    """A registered model and its one version, with facts but no checkpoint behind them, for a bench's
    deployments: (model, version)."""
    from registry.models import ModelVersion, RegisteredModel

    model = RegisteredModel.objects.create(name="bench-tiny", task="generate")
    version = ModelVersion.objects.create(
        model=model, number=1, artifact_uri="/nonexistent/bench", digest="0" * 64, manifest=[],
        architecture="LlamaForCausalLM", parameter_count=1, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=320, max_context=512, dtype="float32", weight_bytes=1,
        kv_cache_bytes_per_token=1, has_tokenizer=True, has_chat_template=True)
    return model, version
