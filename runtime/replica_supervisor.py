"""Runs one replica's server as its child and writes down how it ended.

The local driver starts replicas through this small process, which leads the replica's session.
When the server exits it writes the exit (code, or the signal that ended it) to a status file and
a line to the replica's log, so the control plane can say how a replica died even when the worker
process that started it is gone or is not the one that looks (a prefork pool's other process
cannot wait for it). SIGTERM, SIGINT and SIGHUP sent to this process are passed on to the server,
so stopping the supervisor drains the server as stopping the server itself would.

    python -m runtime.replica_supervisor --status-file PATH -- COMMAND [ARG ...]

Django-free: it runs beside the model server, on the node.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the server, before exec: the kernel kills it when the supervisor dies, so a live
    supervisor always means a live server and a server never outlives its supervisor."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def signal_name(returncode: int) -> str | None:
    """SIGKILL for -9 (how Popen reports a death by signal); None for an exit code."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def describe_exit(returncode: int) -> str:
    """`exited with code 1`, or `killed by signal 9 (SIGKILL)` for a negative returncode."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    return f"killed by signal {-returncode} ({signal_name(returncode)})"


def write_status(path: str, record: dict) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(record, handle)
    os.replace(partial, path)  # a reader sees the whole record or none


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replica_supervisor")
    parser.add_argument("--status-file", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")

    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum, frame):
        if child is None:
            pending.append(signum)  # arrived before the server existed
        else:
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        child = subprocess.Popen(command, preexec_fn=die_with_parent)
    except OSError as exc:
        print(f"--- could not start {command[0]}: {exc}", flush=True)
        write_status(args.status_file, {"pid": None, "returncode": 127, "ended_at": time.time(),
                                        "error": str(exc)})
        return 127
    for signum in pending:
        child.send_signal(signum)
    returncode = child.wait()
    write_status(args.status_file, {"pid": child.pid, "returncode": returncode,
                                    "signal": signal_name(returncode), "ended_at": time.time()})
    print(f"--- replica process {child.pid} {describe_exit(returncode)}", flush=True)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
