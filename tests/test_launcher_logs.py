"""`inferops run`'s log, readable for hours: the worker and beat it starts keep task chatter out (a
failed task still shows), a refused request is one line without a traceback, and a short summary of
where things are comes back on a timer and on SIGUSR1."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading

import pytest

from inferops.celery import app
from inferops.redis_client import redis_client
from project import launcher
from tests.processes import stop_process
from tests.waiting import wait_until


def launcher_child(name: str, tmp_path) -> list[str]:
    args = argparse.Namespace(host="127.0.0.1", port=8000, gateway_port=8080, worker_concurrency=1,
                              batch_concurrency=1)
    os.environ.setdefault("INFEROPS_DATA_DIR", str(tmp_path))
    return next(child.argv for child in launcher.children(args) if child.name == name)


class Running:
    """A launcher child with its output collected line by line."""

    def __init__(self, argv: list[str], tmp_path) -> None:
        env = {**os.environ, "INFEROPS_DATA_DIR": str(tmp_path), "INFEROPS_LOG_LEVEL": "INFO"}
        env.pop("INFEROPS_LOG_FORMAT", None)
        self.process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.process.stdout.readline, "")),
                         daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        stop_process(self.process, 30, group=True)


@pytest.fixture
def own_redis_db():
    redis_client().flushdb()  # the tasks beat enqueued below must not reach another test's worker
    yield
    redis_client().flushdb()


def test_the_worker_keeps_task_chatter_out_but_shows_a_failure(tmp_path, own_redis_db):
    worker = Running(launcher_child("worker", tmp_path), tmp_path)
    try:
        wait_until(lambda: " ready." in worker.text(), worker.text, timeout=90)
        for n in range(3):
            app.send_task("celery.accumulate", args=(n,))
        app.send_task("celery.map", args=("no-such-task", [1]))  # fails in the worker
        wait_until(lambda: "raised unexpected" in worker.text(), worker.text, timeout=60)
    finally:
        worker.stop()
    text = worker.text()
    assert "ERROR" in text and "celery.map" in text  # failures stay visible, with their traceback
    assert " received" not in text and "succeeded in" not in text, text


def test_beat_keeps_its_sending_lines_out(tmp_path, own_redis_db):
    argv = launcher_child("beat", tmp_path)
    beat = Running(argv, tmp_path)
    try:
        # ingest-usage is due every 2 s: once it is queued, beat has sent tasks, silently.
        wait_until(lambda: redis_client().llen("celery") >= 2, beat.text, timeout=60)
    finally:
        beat.stop()
    assert "celery beat" in beat.text() and "is starting" in beat.text()
    assert "Sending due task" not in beat.text(), beat.text()


def test_task_lines_come_back_at_debug(tmp_path):
    probe = ("import django, logging; django.setup(); "
             "print(logging.getLogger('celery.app.trace').isEnabledFor(logging.INFO))")
    for level, shown in (("DEBUG", "True"), ("INFO", "False")):
        env = {**os.environ, "INFEROPS_LOG_LEVEL": level, "DJANGO_SETTINGS_MODULE": "project.settings",
               "INFEROPS_DATA_DIR": str(tmp_path)}
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == shown, result.stderr


@pytest.mark.django_db
def test_a_refused_request_logs_one_line_without_a_traceback(client, make_user, caplog):
    client.force_login(make_user("viewer"))
    with caplog.at_level(logging.INFO):
        response = client.get("/audit/")  # admins only: the view raises PermissionDenied
    assert response.status_code == 403
    refused = [r for r in caplog.records if r.name == "django.request"]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert refused[0].getMessage() == "Forbidden (Permission denied): /audit/"
    assert refused[0].exc_info is None and "Traceback" not in caplog.text


def test_the_banner_says_where_everything_is(tmp_path, monkeypatch):
    monkeypatch.setenv("INFEROPS_DATA_DIR", str(tmp_path))
    text = launcher.banner(console="http://127.0.0.1:8000", gateway="http://127.0.0.1:8080", demo_key="iop_demo",
                           login=launcher.password_lines("s3cret-pw"))
    lines = text.splitlines()
    assert "  console   http://127.0.0.1:8000/" in lines
    assert "  gateway   http://127.0.0.1:8080/v1   (OpenAI-compatible; API keys from Tenants)" in lines
    assert "  demo key  iop_demo" in lines
    assert any(line.startswith("  log in as 'admin' with password s3cret-pw") for line in lines)
    assert f"replicas in {tmp_path / 'replicas'}" in text and "this terminal" in text
    assert f"kill -USR1 {os.getpid()}" in text and "every 10 min" in text
    assert len(lines) <= 14  # short: it comes back every 10 minutes
    later = launcher.banner(console="http://h:1", gateway="http://h:2", demo_key=None, login=[])
    assert "demo key  shown on the first run only" in later and "iop_" not in later


def test_the_banner_repeats_on_its_timer_and_when_asked():
    repeat = launcher.BannerRepeat(600, now=1000.0)
    assert not repeat.due(1000.5) and not repeat.due(1599.9)
    assert repeat.due(1600.0)
    assert not repeat.due(1600.5)  # the next one is 600 s after this one
    repeat.ask()  # SIGUSR1
    assert repeat.due(1700.0) and not repeat.due(1700.5)
    assert not repeat.due(2299.0) and repeat.due(2300.0)  # asking restarted the timer
