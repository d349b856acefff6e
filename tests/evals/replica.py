"""A real `inferops serve` process of a demo checkpoint, for the scoring tests (client,
scorers, lm-eval parity): the replica an eval run talks to, with nothing in between."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.processes import stop_process
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MAX_MODEL_LEN = 512


class Replica:
    """`inferops serve` on a free port; `start()` returns once it listens, `wait_ready()` once
    its model has loaded."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_dir = model_dir
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> Replica:
        command = [sys.executable, "-m", "project.cli", "serve", "--model", str(self.model_dir),
                   "--port", str(self.port), "--served-model-name", MODEL,
                   "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
                   "--cpu-threads", "1"]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        return self

    def first_health(self) -> int:
        """The status of the first /health that answers: 503 while the model loads."""
        answers: list[int] = []

        def answered() -> bool:
            self._check_alive()
            answers.append(httpx.get(f"{self.base_url}/health", timeout=1).status_code)
            return True

        wait_until(answered, "the replica to listen", 60, 0.02, ignore=(httpx.TransportError,))
        return answers[0]

    def wait_ready(self) -> Replica:
        def ready() -> bool:
            self._check_alive()
            return httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200

        wait_until(ready, lambda: f"the replica to be ready\n{self.log_path.read_text()}", 120,
                   0.1, ignore=(httpx.TransportError,))
        return self

    def _check_alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the replica exited early:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
