"""Processes a test starts (`inferops` CLI commands) and their connection URLs: the test database
and Redis, or other ones on the same servers (a second installation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
from django.conf import settings
from django.db import connection

from project.embedded import postgres_url_for_socket_dir
from tests.processes import stop_process
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]


def database_url(name: str | None = None) -> str:
    """A URL for database `name` (default: the test database) on the test's Postgres server."""
    database = connection.settings_dict
    name = name or database["NAME"]
    if database["HOST"].startswith("/"):  # the embedded Postgres listens on a Unix socket
        return postgres_url_for_socket_dir(database["HOST"], name)
    host = f"{database['HOST'] or '127.0.0.1'}:{database['PORT'] or 5432}"
    return f"postgres://{database['USER']}@{host}/{name}"


def redis_url(db: int) -> str:
    """The test's Redis server, database `db`."""
    parsed = urlparse(settings.REDIS_URL)
    if parsed.scheme == "unix":
        return f"unix://{parsed.path}?db={db}"
    return parsed._replace(path=f"/{db}").geturl()


def redis_db() -> int:
    parsed = urlparse(settings.REDIS_URL)
    if parsed.scheme == "unix":
        return int(dict(part.split("=", 1) for part in parsed.query.split("&") if "=" in part).get("db", 0))
    return int(parsed.path.lstrip("/") or 0)


class Process:
    def __init__(self, args: list[str], log_path: Path, health_url: str) -> None:
        self.log_path = log_path
        self.health_url = health_url
        self.log = open(log_path, "w")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "project.cli", *args], cwd=REPO_ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited early:\n{self.log_path.read_text()}")
            return httpx.get(self.health_url, timeout=1).status_code == 200

        wait_until(healthy, lambda: f"{self.health_url} to answer 200\n{self.log_path.read_text()}", timeout, 0.1,
                   ignore=(httpx.TransportError,))

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def start_worker(env, tmp_path, name, queues="celery,batches"):
    """A Celery worker with beat (in its own session) on `queues` (every queue by default), its output in
    tmp_path/<name>.log."""
    log = open(tmp_path / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "inferops.celery", "worker", "--beat", "--loglevel", "INFO",
         "--concurrency", "2", "--hostname", f"{name}@%h", "--schedule", str(tmp_path / "beat-schedule"),
         "--queues", queues],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
