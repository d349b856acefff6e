"""The embedded path: no DATABASE_URL / REDIS_URL -> real Postgres and Redis under the data dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.waiting import wait_until

PROBE = """
import json, os, pathlib
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
django.setup()
from django.conf import settings
# Reading the settings starts nothing (an image build or collectstatic must not); the launcher does.
data = pathlib.Path(os.environ["INFEROPS_DATA_DIR"])
assert not (data / "postgres" / "postmaster.pid").exists() and not (data / "redis" / "redis.pid").exists()
from project import embedded
embedded.ensure_services()
from django.db import connection
import redis
with connection.cursor() as cursor:
    cursor.execute("SELECT version(), 40 + 2")
    version, answer = cursor.fetchone()
client = redis.Redis.from_url(settings.REDIS_URL)
client.set("probe", "ok")
print(json.dumps({"pg": version, "answer": answer, "redis": client.get("probe").decode(),
                  "database_url": os.environ["DATABASE_URL"], "redis_url": os.environ["REDIS_URL"]}))
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_embedded_services_start_serve_and_stop(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env["INFEROPS_DATA_DIR"] = str(tmp_path / "data")
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["pg"].startswith("PostgreSQL") and facts["answer"] == 42
    assert facts["redis"] == "ok"
    assert str(tmp_path / "data") in facts["database_url"].replace("%2F", "/")
    assert facts["redis_url"].startswith("unix://")
    # The process that started them stopped them on exit.
    redis_pid = int((tmp_path / "data" / "redis" / "redis.pid").read_text()) if (
        tmp_path / "data" / "redis" / "redis.pid").exists() else None
    postmaster = tmp_path / "data" / "postgres" / "postmaster.pid"
    # 60 s: a fast shutdown checkpoint can take a while on a loaded machine.
    wait_until(lambda: not postmaster.exists(), "the embedded Postgres to stop", 60, 0.2)
    wait_until(lambda: not (redis_pid and pid_alive(redis_pid)), "the embedded Redis to stop", 60, 0.2)
