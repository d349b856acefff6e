"""The replica layer moved from the `runtime` app to `deployments` (migration deployments 0003):
a database migrated before the move keeps its replica and metrics tables and every row in them,
and ends with the same schema as a database made after it.

The old tables come from tests/fixtures/runtime_tables_before_move.sql, the schema the runtime
app's migrations made (pg_dump -s); the rows are written through today's models, which map to
the same tables. Each database is migrated by `manage.py migrate` in a subprocess, as an upgrade
would be.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from tests.services import database_url

ROOT = Path(__file__).resolve().parents[2]
OLD_TABLES = ROOT / "tests" / "fixtures" / "runtime_tables_before_move.sql"

SEED = """
import datetime, django, json, sys
django.setup()
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from deployments.models import Deployment, Replica, ReplicaMetricsHour, ReplicaMetricsMinute
from registry import services
model = services.model_create(name="tiny", task="generate", actor=None)
version = services.version_register(model=model, artifact_uri=sys.argv[1], actor=None)
# Written as migration 0002 knew the row: today's Deployment has columns added since.
from django.db.migrations.loader import MigrationLoader
then = MigrationLoader(connection).project_state(("deployments", "0002_rollouts")).apps
row = then.get_model("deployments", "Deployment").objects.create(name="chat", model_id=model.pk, version_id=version.pk)
deployment = Deployment(pk=row.pk)
# The replica tables as that database has them: today's columns it lacks (added by later migrations) are left out.
with connection.cursor() as cursor:
    for table_model in (Replica, ReplicaMetricsMinute, ReplicaMetricsHour):
        columns = {c.name for c in connection.introspection.get_table_description(cursor, table_model._meta.db_table)}
        for newer in [f for f in table_model._meta.local_fields if f.column not in columns]:
            table_model._meta.local_fields.remove(newer)
        table_model._meta._expire_cache()
start = datetime.datetime(2026, 12, 1, 10, 0, tzinfo=datetime.UTC)
for n in range(3):
    replica = Replica.objects.create(deployment=deployment, version=version, node="vm", state="ready",
                                     identity={"pid": 100 + n}, last_error=f"error {n}")
    ReplicaMetricsMinute.objects.create(replica=replica, deployment=deployment, version=version, start=start,
                                        generation_tokens=10 * n, ttft_buckets={"0.1": n})
    ReplicaMetricsHour.objects.create(replica=replica, deployment=deployment, version=version, start=start,
                                      generation_tokens=600 * n)
with connection.cursor() as cursor:  # what the runtime app's migrations had recorded
    cursor.executemany("INSERT INTO django_migrations (app, name, applied) VALUES ('runtime', %s, now())",
                       [("0001_initial",), ("0002_rollouts",)])
    cursor.executemany("UPDATE django_content_type SET app_label = 'runtime' WHERE app_label = 'deployments' "
                       "AND model = %s", [(m,) for m in ("replica", "replicametricsminute", "replicametricshour")])
"""

CHECK = """
import django, json
django.setup()
from django.contrib.contenttypes.models import ContentType
from deployments.models import Deployment, Replica, ReplicaMetricsHour, ReplicaMetricsMinute
from inferops.models import AuditEvent
replicas = Replica.objects.order_by("pk")
new = Replica.objects.create(deployment=Deployment.objects.get(name="chat"), version=replicas[0].version, node="vm")
print(json.dumps({
    "replicas": [(r.pk, r.deployment.name, r.identity, r.last_error) for r in replicas.exclude(pk=new.pk)],
    "minutes": sorted(ReplicaMetricsMinute.objects.values_list("replica_id", "generation_tokens", "ttft_buckets")),
    "hours": sorted(ReplicaMetricsHour.objects.values_list("replica_id", "generation_tokens")),
    "new_id": new.pk,
    "content_types": sorted(ContentType.objects.filter(app_label__in=["runtime", "deployments"],
                                                       model__startswith="replica").values_list("app_label", "model")),
    "audit": sorted(AuditEvent.objects.values_list("action", flat=True)),
}))
"""


def admin() -> psycopg.Connection:
    params = connection.get_connection_params()
    params["dbname"] = "postgres"
    return psycopg.connect(**params, autocommit=True)


@pytest.fixture
def make_database():
    names = []

    def make(suffix: str) -> str:
        name = f"{connection.settings_dict['NAME']}_{suffix}"
        with admin() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        return name

    yield make
    with admin() as cursor:
        for name in names:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(name: str, *args: str) -> str:
    env = {**os.environ, "DATABASE_URL": database_url(name), "DJANGO_SETTINGS_MODULE": "project.settings"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[:3]}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def schema(name: str) -> dict:
    params = connection.get_connection_params()
    params["dbname"] = name
    with psycopg.connect(**params) as db:
        columns = db.execute("SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns "
                             "WHERE table_name LIKE 'runtime_%' ORDER BY 1, 2").fetchall()
        indexes = db.execute("SELECT tablename, indexdef FROM pg_indexes WHERE tablename LIKE 'runtime_%' "
                             "ORDER BY 1, 2").fetchall()
        constraints = db.execute("SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
                                 "WHERE conrelid::regclass::text LIKE 'runtime_%' ORDER BY 1, 2").fetchall()
    return {"columns": columns, "indexes": indexes, "constraints": constraints}


@pytest.mark.django_db
def test_a_database_from_before_the_move_keeps_its_replicas_and_metrics(make_database, tiny_llama_dir):
    old = make_database("before_move")
    run(old, "manage.py", "migrate", "deployments", "0002_rollouts", "--verbosity", "0")
    params = connection.get_connection_params()
    params["dbname"] = old
    with psycopg.connect(**params, autocommit=True) as db:
        db.execute(OLD_TABLES.read_text())
    run(old, "-c", SEED, str(tiny_llama_dir))

    run(old, "manage.py", "migrate", "--verbosity", "0")
    import json

    after = json.loads(run(old, "-c", CHECK).strip().splitlines()[-1])
    assert after["replicas"] == [[n + 1, "chat", {"pid": 100 + n}, f"error {n}"] for n in range(3)]
    assert after["minutes"] == [[n + 1, 10 * n, {"0.1": n}] for n in range(3)]
    assert after["hours"] == [[n + 1, 600 * n] for n in range(3)]
    assert after["new_id"] == 4  # the table's identity sequence carries on
    assert after["audit"] == ["model.create", "version.register"]  # registry 0001's table, kept by inferops 0002
    assert after["content_types"] == [["deployments", "replica"], ["deployments", "replicametricshour"],
                                      ["deployments", "replicametricsminute"], ["deployments", "replicastart"]]

    new = make_database("after_move")
    run(new, "manage.py", "migrate", "--verbosity", "0")
    assert schema(old) == schema(new)
