"""`inferops run` (what `make run` calls) on a fresh data directory, with embedded services.

Starts the real thing: embedded Postgres and Redis, uvicorn, a Celery worker and beat. Checks the
printed admin password logs in, the console serves, a beat-scheduled task runs on the worker,
and Ctrl-C stops every process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import requests

from tests.conftest import free_port
from tests.waiting import wait_until


def descendants(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if parent == pid:
            found.add(int(entry))
            found |= descendants(int(entry))
    return found


def test_run_serves_console_runs_worker_and_stops_on_ctrl_c(tmp_path):
    port, gateway_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "INFEROPS_EXTERNAL_URL"}}
    env.update(INFEROPS_DATA_DIR=str(tmp_path / "data"), INFEROPS_HEARTBEAT_S="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "project.cli", "run", "--port", str(port), "--gateway-port", str(gateway_port),
         "--worker-concurrency", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        def worker_ok() -> dict | None:
            health = requests.get(f"{base}/healthz", timeout=2).json()
            return health if health.get("worker") == "ok" else None

        health = wait_until(worker_ok, lambda: f"the worker's health to be ok\n{''.join(output)}", 120, 0.5,
                            ignore=(requests.RequestException,))
        text = "".join(output)
        assert health["database"] == "ok" and health["redis"] == "ok"
        assert f"console   {base}/" in text
        password = re.search(r"log in as 'admin' with password (\S+)", text).group(1)

        session = requests.Session()
        login_page = session.get(f"{base}/login/", timeout=5)
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login_page.text).group(1)
        response = session.post(f"{base}/login/", data={
            "username": "admin", "password": password, "csrfmiddlewaretoken": csrf,
        }, headers={"Referer": f"{base}/login/"}, timeout=5)
        assert response.status_code == 200 and "Models" in response.text
        assert response.url == f"{base}/"  # the home page: who is on call, what is firing

        # The demo deployment: a real replica of the demo checkpoint, answering within a minute.
        def demo_ready() -> bool:
            assert process.poll() is None, "".join(output)
            return "The demo deployment is ready" in "".join(output)

        wait_until(demo_ready, lambda: f"the demo deployment\n{''.join(output)}", 120, 0.5)
        # The end of start-up says how to log in again, and the password stays in a file only its owner reads.
        ready = "".join(output).split("The demo deployment is ready", 1)[1]
        assert f"log in as 'admin' with password {password}" in ready
        password_file = tmp_path / "data" / "admin-password"
        assert password_file.stat().st_mode & 0o777 == 0o600 and f"password: {password}" in password_file.read_text()
        # Links in notifications name the address the console was started on (no INFEROPS_EXTERNAL_URL).
        page = session.get(f"{base}/alerts/integrations/", timeout=5)
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        created = session.post(f"{base}/alerts/integrations/", data={"name": "am", "csrfmiddlewaretoken": csrf},
                               headers={"Referer": f"{base}/alerts/integrations/"}, timeout=5)
        assert f"url: {base}/api/v1/alerts/alertmanager/" in created.text
        replica_url = re.search(r"replica (http://\S+)", "".join(output)).group(1)

        chat = requests.post(f"{replica_url}/v1/chat/completions", timeout=30, json={
            "model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        # ... and through the gateway with the demo key printed once, as a new user would.
        from openai import OpenAI

        key = re.search(r"Bearer (iop_\S+)'", "".join(output)).group(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=key)
        pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True)
            if chunk.choices]
        assert len(pieces) >= 1
        # The Files and Batches API reaches the web app through the gateway (whatever it answers,
        # not the gateway's "control plane unreachable").
        files = requests.get(f"http://127.0.0.1:{gateway_port}/v1/files", timeout=10,
                             headers={"Authorization": f"Bearer {key}"})
        assert files.status_code not in (502, 503, 504), files.text
        detail = session.get(f"{base}/deployments/demo/", timeout=5)
        assert detail.status_code == 200 and replica_url in detail.text
        children = descendants(process.pid)
        assert len(children) >= 5  # web, gateway, worker (+ its pool), beat, the demo replica
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert process.returncode == 0, "".join(output)

    def alive():
        return [pid for pid in children if os.path.exists(f"/proc/{pid}") and
                open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    wait_until(lambda: alive() == [], lambda: f"every child to exit (alive: {alive()})\n{''.join(output)}", 10, 0.1)


def test_a_child_that_exits_by_itself_is_started_again_until_it_keeps_exiting():
    """Chaos suite: a Celery worker exits when Redis drops under it at the wrong moment (kombu), and
    `inferops run` then stopped everything; compose and Kubernetes start it again, and so does it now."""
    from project.launcher import RESTART_WINDOW_S, RESTARTS_ALLOWED, Child

    child = Child("flaky", [sys.executable, "-c", "pass"])
    child.start()
    child.process.wait()
    for n in range(RESTARTS_ALLOWED):
        assert child.restart_after_exit(100.0 + n)
        child.process.wait()
    assert not child.restart_after_exit(100.0 + RESTARTS_ALLOWED)  # one exit too many in the window
    assert child.restart_after_exit(101.0 + RESTARTS_ALLOWED + RESTART_WINDOW_S)  # the old exits have aged out
    child.process.wait()


def test_the_gateway_forwards_files_and_batches_to_the_web_app_it_runs_beside():
    import argparse

    from project.launcher import children, local_url

    for host, url in (("127.0.0.1", "http://127.0.0.1:8001"), ("0.0.0.0", "http://127.0.0.1:8001"),
                      ("::", "http://[::1]:8001"), ("10.1.2.3", "http://10.1.2.3:8001")):
        args = argparse.Namespace(host=host, port=8001, gateway_port=8081, worker_concurrency=1, batch_concurrency=1)
        (gateway,) = [child for child in children(args) if child.name == "gateway"]
        assert gateway.argv[gateway.argv.index("--control-plane-url") + 1] == url == local_url(host, 8001)


def test_batches_get_a_worker_of_their_own_on_their_queue():
    import argparse

    from project.launcher import children

    args = argparse.Namespace(host="127.0.0.1", port=8001, gateway_port=8081, worker_concurrency=2, batch_concurrency=3)
    workers = {child.name: child.argv for child in children(args) if "celery" in child.argv and "worker" in child.argv}
    assert set(workers) == {"worker", "batch-worker"}
    batch = workers["batch-worker"]
    assert batch[batch.index("--queues") + 1] == "batches" and batch[batch.index("--concurrency") + 1] == "3"
    assert "--queues" not in workers["worker"]  # the default queue: every other task
