"""Connection URLs for processes a test starts: the test database and Redis, or other ones
on the same servers (a second installation)."""

from __future__ import annotations

from urllib.parse import urlparse

from django.conf import settings
from django.db import connection

from inferops.embedded import postgres_url_for_socket_dir


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
