"""Two installations on one machine: two databases, two data directories, one Redis server with
a database each. Both have a replica with id 1; whatever one does to its replicas (reconcile,
kill, re-adopt, scale to zero) never touches the other's process.

Installation A is this test's database, with its sequences reset so its first replica is id 1.
Installation B is a second database on the same Postgres, driven by tests/deployments/twin_installation.py
in subprocesses, as a second worker on the same machine would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
import redis
from django.db import connection

from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Replica
from deployments.replicas import routing
from deployments.replicas.drivers.local import LocalProcessDriver, process_start_time
from registry import services as registry_services
from tests.deployments.test_reconcile import FAST, all_ready, live_replicas, reconcile_until
from tests.services import database_url, redis_db, redis_url

pytestmark = pytest.mark.django_db(transaction=True, reset_sequences=True)

ROOT = Path(__file__).resolve().parents[2]


def admin_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    params["dbname"] = "postgres"
    return psycopg.connect(**params, autocommit=True)


@pytest.fixture
def twin(tmp_path, tiny_llama_dir):
    """Installation B: its own database (migrated), Redis database and data directory."""
    name = f"{connection.settings_dict['NAME']}_twin"
    with admin_connection() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    env = {**os.environ, "DATABASE_URL": database_url(name), "REDIS_URL": redis_url((redis_db() + 1) % 16),
           "INFEROPS_DATA_DIR": str(tmp_path / "twin"), "DJANGO_SETTINGS_MODULE": "project.settings",
           "TWIN_DEPLOYMENT": f"twin-{uuid.uuid4().hex[:8]}"}
    env.pop("DATABASE_TEST_NAME", None)

    def run(*args: str) -> dict:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, f"twin {args}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1]) if args[0] == "-m" else {}

    run("manage.py", "migrate", "--verbosity", "0")
    def command(*args: str) -> dict:
        return run("-m", "tests.deployments.twin_installation", *args)

    command.deployment = env["TWIN_DEPLOYMENT"]
    yield command
    run("-m", "tests.deployments.twin_installation", "scale-to-zero")  # its replicas stop with the test
    with admin_connection() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def running(process: dict) -> bool:
    """The very process (pid and start time) is still there."""
    return process_start_time(process["pid"]) == process["start_time"]


def test_replica_1_of_each_installation_is_left_alone_by_the_other(
        settings, tmp_path, tiny_llama_dir, make_user, twin):
    settings.INFEROPS_RECONCILE_TIMINGS = FAST
    settings.INFEROPS_DATA_DIR = tmp_path / "ours"
    operator = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=operator)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=operator)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, replicas=1,
                                                       actor=operator)
    try:
        reconcile_until(deployment, all_ready(1))
        ours = live_replicas(deployment)[0]
        their = twin("deploy", str(tiny_llama_dir))
        assert ours.pk == 1 and their["id"] == 1  # the same replica id in both databases
        # Each publishes its routes in its own Redis database.
        assert "chat" in routing.read_table() and twin.deployment not in routing.read_table()
        their_routes = redis.Redis.from_url(redis_url((redis_db() + 1) % 16)).hkeys(routing.ROUTING_KEY)
        assert twin.deployment.encode() in their_routes

        # They kill and replace their replica 1: ours runs on, and our passes keep it.
        their = twin("kill")
        reconcile_deployment_passes(deployment, 3)
        ours.refresh_from_db()
        assert ours.state == ReplicaState.READY and running(ours.identity) and running(their)

        # Our worker died before saving the pid: we re-adopt our process, not theirs.
        pid = ours.identity["pid"]
        Replica.objects.filter(pk=ours.pk).update(identity={})
        reconcile_deployment_passes(deployment, 2)
        ours.refresh_from_db()
        assert ours.identity["pid"] == pid and ours.state == ReplicaState.READY and running(their)

        # Our row points at their process (a database restored from their backup): we neither
        # adopt nor signal it; our replica is restarted, its untracked old process killed.
        old = dict(ours.identity)
        Replica.objects.filter(pk=ours.pk).update(identity={**ours.identity, **their})
        reconcile_until(deployment, lambda d: all_ready(1)(d) and Replica.objects.get(pk=ours.pk).restarts == 1)
        ours.refresh_from_db()
        assert running(their) and not running(old) and ours.identity["pid"] not in (their["pid"], old["pid"])

        # We scale to zero: our replica drains and stops; theirs runs on.
        deployment_services.deployment_update(deployment=deployment, actor=operator, replicas=0)
        reconcile_until(deployment, lambda d: not live_replicas(d))
        assert not running(ours.identity) and running(their)
    finally:
        for replica in Replica.objects.all():
            LocalProcessDriver().kill(replica)


def reconcile_deployment_passes(deployment, passes: int) -> None:
    from deployments.replicas.reconcile import reconcile_deployment

    for _ in range(passes):
        assert reconcile_deployment(deployment.pk) == "ok"
