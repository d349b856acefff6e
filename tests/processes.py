"""Stopping a process a test started, Django-free (the gateway and engine suites use it too)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process(process: subprocess.Popen, grace_s: float = 10, *, group: bool = False) -> None:
    """SIGTERM `process` (with `group`, its whole process group: what it started in its session
    too), then SIGKILL it if it has not exited within `grace_s`."""

    def send(signum: int) -> None:
        try:
            if group:
                os.killpg(process.pid, signum)
            elif process.poll() is None:
                process.send_signal(signum)
        except ProcessLookupError:  # gone already
            pass

    send(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        process.wait()
