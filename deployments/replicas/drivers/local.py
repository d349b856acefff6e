"""Local process driver: replicas as child processes on the worker's own node.

Each replica runs in its own session under `runtime.replica_supervisor`, so a Celery worker that
restarts does not take its replicas down with it, and how a replica ended is written down even
when no worker waits for it. The next reconcile re-adopts a replica from the identity stored on
its row: the pid, the kernel's start time for that pid (a recycled pid is never mistaken for
ours), and a marker in the process's environment naming this installation and the replica
(`INFEROPS_REPLICA=<installation id>/<replica id>`). All three must agree before the driver
signals or adopts a process: replica ids start at 1 in every database, so a second installation
on the same machine (a staging stack, the test suite) has its own replica 1, and a database
restored on another installation's machine carries pids that are not its own. A worker killed
between starting a process and saving its pid finds it again by the marker alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from functools import cached_property
from pathlib import Path

from django.conf import settings

from deployments import engine_args as engine_args_mod
from deployments.replicas.drivers.base import DriverError, NoCapacity, ReplicaSpec, Started
from inferops.models import installation_id
from inferops.replica_admin import ADMIN_TOKEN_ENV, replica_admin_token
from runtime.replica_supervisor import describe_exit
from runtime.vllm_preload import vllm_cpu_preload

log = logging.getLogger(__name__)

REPLICA_ENV = "INFEROPS_REPLICA"
# The marker of replicas started before installations had ids: trusted only together with the
# pid and start time on the row, never found by a scan.
LEGACY_REPLICA_ENV = "INFEROPS_REPLICA_ID"

# What a replica inherits from the worker's environment: what a model server needs to find its
# libraries, caches and devices, and nothing of the control plane's (database and Redis URLs,
# SECRET_KEY, the admin password): a model server may run third-party code.
# INFEROPS_REPLICA_ENV names more variables to pass (comma-separated).
PASSED_ENV = {
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "CC", "SSL_CERT_FILE", "SSL_CERT_DIR", "XDG_CACHE_HOME",
    "INFEROPS_KERNEL_CACHE", "INFEROPS_ADMIN_TOKEN",
}
PASSED_PREFIXES = ("LC_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "CUDA_", "NVIDIA_", "OMP_", "KMP_",
                   "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "TORCH_", "PYTORCH_")


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


def replica_marker(installation: str, replica_id: int) -> str:
    return f"{installation}/{replica_id}"


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment pid was started with; None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def session_leader(pid: int) -> bool:
    """Whether pid leads its session: the supervisor does, the server it runs does not."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return False
    return int(fields[3]) == pid


def find_replica_process(marker: str) -> int | None:
    """The supervisor of the replica whose environment carries this exact marker, by /proc scan."""
    needle = f"{REPLICA_ENV}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle not in handle.read().split(b"\0"):
                    continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if session_leader(int(entry)):
            return int(entry)
    return None


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# What `make vllm` creates at the top of the checkout: vLLM's pins conflict with the project's.
VLLM_VENV = ".venv-vllm"
VLLM_MISSING = ("no vLLM is installed for the local driver: run `make vllm` on the worker's machine "
                "(vllm-cpu in .venv-vllm; `make vllm VLLM_PACKAGE=vllm` for the CUDA build), or set "
                "INFEROPS_VLLM_PYTHON to a Python that has vLLM")


def vllm_python() -> str | None:
    """The Python that runs vLLM replicas: INFEROPS_VLLM_PYTHON when set, else `make vllm`'s
    environment, else the environment of a `vllm` command on PATH; None when there is none."""
    configured = getattr(settings, "INFEROPS_VLLM_PYTHON", "")
    if configured:
        return configured
    made = Path(settings.BASE_DIR) / VLLM_VENV / "bin" / "python"
    if made.is_file():
        return str(made)
    command = shutil.which("vllm")
    if command and (Path(command).parent / "python").is_file():
        return str(Path(command).parent / "python")
    return None


def vllm_missing() -> str | None:
    """Why the local driver could not start a vLLM replica here, or None when it could.

    An INFEROPS_VLLM_PYTHON that is set is trusted as it is: the web process that asks may run in
    another container than the worker it names a path on (a wrong path fails the replica's start).
    """
    return VLLM_MISSING if vllm_python() is None else None


def replica_command(spec: ReplicaSpec, host: str, port: int) -> list[str]:
    args = engine_args_mod.to_argv(spec.run_args, spec.backend)
    if spec.backend == "vllm":
        python = vllm_python()
        if python is None:
            raise DriverError(VLLM_MISSING)
        # Not `vllm serve`: vllm-cpu's CLI looks up the distribution "vllm" for its version and fails.
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                spec.model_path, "--served-model-name", spec.deployment, "--host", host,
                "--port", str(port), *args]
    return [sys.executable, "-m", "project.cli", "serve", "--model", spec.model_path,
            "--served-model-name", spec.deployment, "--host", host, "--port", str(port), *args]


class NoFreeGpus(NoCapacity):
    """Not enough of this node's GPUs are free for the replica; it waits, it has not failed."""


def node_gpus() -> list[str]:
    """This node's GPU indexes: INFEROPS_NODE_GPUS ("0,1,2,3") when set, else the worker's own
    CUDA_VISIBLE_DEVICES, else the devices the NVIDIA driver lists."""
    configured = getattr(settings, "INFEROPS_NODE_GPUS", None)
    if configured is None:
        configured = os.environ.get("INFEROPS_NODE_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [item.strip() for item in str(configured).split(",") if item.strip()]
    try:
        return [str(index) for index in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


class GpuLedger:
    """Which of this node's GPUs each local replica holds, in a file under the data directory.

    The file outlives workers, so a restarted worker never hands a device to a second replica;
    an entry counts only while a process carrying its replica's marker runs (a replica that
    died frees its devices without anyone cleaning up). Allocation and the spawn that makes the
    holder visible happen under one file lock, so two workers on a node cannot take one device.
    """

    def __init__(self, path: Path):
        self.path = path

    @contextlib.contextmanager
    def locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def read(self) -> dict[str, str]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def write(self, held: dict[str, str]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(held, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def allocate(self, marker: str, count: int, devices: list[str]) -> list[str]:
        """count devices for marker (its own earlier ones first); call with the lock held."""
        held = {device: holder for device, holder in self.read().items()
                if device in devices and (holder == marker or find_replica_process(holder) is not None)}
        mine = [device for device in devices if held.get(device) == marker]
        free = [device for device in devices if device not in held]
        if len(mine) + len(free) < count:
            busy = ", ".join(f"{device} by replica {holder.rsplit('/', 1)[-1]}" for device, holder in held.items()
                             if holder != marker) or "none"
            raise NoFreeGpus(f"needs {count} GPU(s) but node {node_name()} has {len(free) + len(mine)} free of "
                             f"{len(devices)} (in use: {busy}); it starts when enough are free")
        chosen = (mine + free)[:count]
        held = {device: holder for device, holder in held.items() if holder != marker}
        self.write({**held, **dict.fromkeys(chosen, marker)})
        return chosen

    def held_by(self, marker: str) -> list[str]:
        """The devices the ledger gives marker, in index order (read without the lock: a snapshot)."""
        held = [device for device, holder in self.read().items() if holder == marker]
        return sorted(held, key=lambda device: (not device.isdigit(), int(device) if device.isdigit() else 0, device))


def supervised(argv: list[str], status_path: Path) -> list[str]:
    return [sys.executable, "-m", "runtime.replica_supervisor", "--status-file", str(status_path), "--", *argv]


def passed_env(environ: dict[str, str]) -> dict[str, str]:
    extra = {name.strip() for name in settings.INFEROPS_REPLICA_ENV.split(",") if name.strip()}
    return {name: value for name, value in environ.items()
            if name in PASSED_ENV or name in extra or name.startswith(PASSED_PREFIXES)}


def replica_env(spec: ReplicaSpec, marker: str, gpus: list[str] | None = None) -> dict[str, str]:
    env = {**passed_env(dict(os.environ)), REPLICA_ENV: marker, "PYTHONUNBUFFERED": "1"}
    if spec.backend == "builtin":  # its admin API, for the SLO targets the control plane sets
        env[ADMIN_TOKEN_ENV] = replica_admin_token()
    # Only its own devices: replicas on one node never share one, and a replica given none sees
    # none (so it neither runs on nor reports a GPU of the node).
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus or [])
    preload = getattr(settings, "INFEROPS_VLLM_LD_PRELOAD", "auto")
    # An LD_PRELOAD the operator gave the worker is theirs to keep; "none" turns this off.
    if spec.backend == "vllm" and "LD_PRELOAD" not in env and preload != "none":
        python = vllm_python()
        preload = (vllm_cpu_preload(python) if python else "") if preload == "auto" else preload
        if preload:
            env["LD_PRELOAD"] = preload
    return env


class LocalProcessDriver:
    name = "local"

    def __init__(self, host: str | None = None, log_dir: Path | None = None):
        # Replicas bind to the advertise address and publish it in their URL: 127.0.0.1 for one
        # machine, the worker container's name when the gateway runs in another container.
        self.host = host or getattr(settings, "INFEROPS_ADVERTISE_ADDRESS", "") or "127.0.0.1"
        self.log_dir = log_dir or Path(settings.INFEROPS_DATA_DIR) / "replicas"

    @cached_property
    def installation(self) -> str:
        return installation_id()

    def marker(self, replica) -> str:
        return replica_marker(self.installation, replica.pk)

    @cached_property
    def gpu_ledger(self) -> GpuLedger:
        return GpuLedger(Path(settings.INFEROPS_DATA_DIR) / "gpus.json")

    def held_gpus(self, replica_id: int, identity: dict) -> list[str]:
        """The GPUs of this node that the ledger gives the replica, for reading them through NVML;
        [] for a replica on another node (NVML sees only the devices of the node it runs on)."""
        if identity.get("node") != node_name():
            return []
        return self.gpu_ledger.held_by(replica_marker(self.installation, replica_id))

    def start(self, replica, spec: ReplicaSpec) -> Started:
        gpu_count = spec.resources.get("gpu_count") or 0
        if not gpu_count:
            return self._start(replica, spec, gpus=None)
        with self.gpu_ledger.locked():
            gpus = self.gpu_ledger.allocate(self.marker(replica), gpu_count, node_gpus())
            return self._start(replica, spec, gpus=gpus)

    def _start(self, replica, spec: ReplicaSpec, gpus: list[str] | None) -> Started:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port(self.host)
        log_path = self.log_dir / f"{spec.deployment}-{replica.pk}.log"
        status_path = self.log_dir / f"{spec.deployment}-{replica.pk}.exit.json"
        status_path.unlink(missing_ok=True)  # the previous run's
        stray = find_replica_process(self.marker(replica))
        if stray is not None:  # ours by its marker, but no longer the row's: never run two of one replica
            log.warning("replica %s: killing pid %s, an earlier process of this replica the row lost track of",
                        replica, stray)
            with contextlib.suppress(ProcessLookupError):  # it may have ended since the scan
                os.killpg(stray, signal.SIGKILL)
        argv = replica_command(spec, self.host, port)
        env = replica_env(spec, self.marker(replica), gpus)
        try:
            with open(log_path, "ab") as log_file:
                preload = f"LD_PRELOAD={env['LD_PRELOAD']} " if "LD_PRELOAD" in env else ""
                log_file.write(f"\n--- starting: {preload}{' '.join(argv)}\n".encode())
                log_file.flush()
                process = subprocess.Popen(
                    supervised(argv, status_path), stdout=log_file, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True,
                )
        except OSError as exc:
            raise DriverError(f"could not start {argv[0]}: {exc}") from exc
        return Started(
            url=f"http://{self.host}:{port}",
            port=port,
            identity={"pid": process.pid, "start_time": process_start_time(process.pid), "node": node_name(),
                      "status_path": str(status_path), **({"gpus": gpus} if gpus is not None else {})},
            log_path=str(log_path),
        )

    def _pid(self, replica) -> int | None:
        """The row's pid, when that pid's start time and the marker in its environment both say
        it is this replica's process; a process that fails either test is never ours."""
        pid = replica.identity.get("pid")
        if not pid or process_start_time(pid) != replica.identity.get("start_time"):
            return None  # exited, or the pid now belongs to another process
        environ = process_environ(pid)
        for _ in range(10):
            # A process spawned a moment ago may still show its parent's environment (no marker at
            # all) until its exec completes: look again briefly before judging it foreign.
            if environ is None or REPLICA_ENV in environ or LEGACY_REPLICA_ENV in environ:
                break
            time.sleep(0.05)
            environ = process_environ(pid)
        if environ is None:
            log.warning("replica %s: cannot read the environment of pid %s, so cannot prove it is ours; "
                        "leaving it alone", replica, pid)
            return None
        if environ.get(REPLICA_ENV) == self.marker(replica):
            return pid
        if REPLICA_ENV not in environ and environ.get(LEGACY_REPLICA_ENV) == str(replica.pk):
            return pid  # started before installations had ids; the pid and start time agree
        log.warning("replica %s: pid %s started when the row says, but its marker is %r, not %r: another "
                    "installation's process, left alone", replica, pid,
                    environ.get(REPLICA_ENV, environ.get(LEGACY_REPLICA_ENV)), self.marker(replica))
        return None

    def adopt(self, replica) -> int | None:
        """The pid of replica's process if it still runs, found by identity or by /proc scan.

        A process found by scan was started by a worker that died before saving anything
        about it: its port comes back from its command line.
        """
        pid = self._pid(replica)
        if pid is not None:
            return pid
        pid = find_replica_process(self.marker(replica))
        if pid is None:
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().decode(errors="replace").split("\0")
        port = int(argv[argv.index("--port") + 1])
        status_path = argv[argv.index("--status-file") + 1]
        replica.identity = {**replica.identity, "pid": pid, "start_time": process_start_time(pid),
                            "node": node_name(), "status_path": status_path}
        replica.port, replica.url = port, f"http://{self.host}:{port}"
        replica.log_path = str(self.log_dir / f"{replica.deployment.name}-{replica.pk}.log")
        log.info("replica %s: adopted its running process %s (port %s)", replica, pid, port)
        return pid

    def is_alive(self, replica) -> bool:
        self._reap(replica)
        return self._pid(replica) is not None

    def exit_status(self, replica) -> str:
        """How the replica's process ended: its exit code or the signal that killed it, and
        whether this installation sent that signal (and why)."""
        sent = replica.identity.get("signals") or []
        last_sent = sent[-1] if sent else None
        try:
            with open(replica.identity.get("status_path") or "") as handle:
                status = json.load(handle)
        except (OSError, ValueError):
            status = None
        if status is None:
            if last_sent and last_sent["signal"] == "SIGKILL":
                return f"killed by inferops with SIGKILL ({last_sent['why']})"
            return (f"process {replica.identity.get('pid')} ended without recording its exit status "
                    f"(its supervisor was killed with SIGKILL, e.g. by the OOM killer, or the node restarted)")
        text = describe_exit(status["returncode"])
        if status.get("error"):
            return f"{text}: {status['error']}"
        if status.get("signal"):
            sent_it = last_sent and last_sent["signal"] == status["signal"]
            text += f", sent by inferops ({last_sent['why']})" if sent_it else ", not sent by this installation"
        return text

    def _signal(self, replica, signum: int, why: str) -> None:
        # A process whose pid never reached the row (its worker died right after the spawn) is
        # still found by its marker.
        pid = self._pid(replica) or (find_replica_process(self.marker(replica)) if replica.pk else None)
        if pid is None:
            return
        name = signal.Signals(signum).name
        log.info("replica %s: sending %s to pid %s: %s", replica, name, pid, why)
        replica.identity = {**replica.identity, "signals": [
            *(replica.identity.get("signals") or [])[-4:], {"signal": name, "why": why, "at": time.time()}]}
        self._append_to_log(replica, f"--- inferops sent {name} to pid {pid}: {why}")
        try:
            if signum == signal.SIGKILL:
                os.killpg(pid, signum)  # the supervisor leads the session: reach every process in it
            else:
                os.kill(pid, signum)  # the supervisor passes it to the server, once
        except ProcessLookupError:
            pass

    def stop(self, replica, grace_s: float = 30, why: str = "drain") -> None:
        self._signal(replica, signal.SIGTERM, why)

    def kill(self, replica, why: str = "stop now") -> None:
        self._signal(replica, signal.SIGKILL, why)
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

    def _append_to_log(self, replica, line: str) -> None:
        if replica.log_path:
            try:
                with open(replica.log_path, "a") as handle:
                    handle.write(f"{line}\n")
            except OSError:
                pass

    def log_tail(self, replica, lines: int = 50) -> str:
        if not replica.log_path:
            return ""
        try:
            with open(replica.log_path, errors="replace") as handle:
                return "".join(deque(handle, maxlen=lines))
        except FileNotFoundError:
            return ""
