"""A runner that dies anywhere leaves a batch another runner finishes: beat's tick hands a batch with a
stale heartbeat on (in progress, cancelling, or finalizing), and enqueues a never-started one again only
rarely, so a batch waiting its turn on a busy batch worker does not pile up copies in the queue."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.files.base import ContentFile
from django.utils import timezone

from batches import runner
from batches.models import Batch, BatchFile
from batches.services import read_lines, storage
from tests.batches.conftest import chat_lines
from tests.batches.test_openai_api import client_for, create_batch, upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def enqueued(monkeypatch):
    calls = []
    monkeypatch.setattr("batches.services.enqueue", lambda task, batch_id: calls.append(batch_id))
    return calls


def a_batch(key: str, lines: int = 2) -> Batch:
    client = client_for(key)
    return Batch.objects.get(pk=create_batch(client, upload(client, chat_lines(lines)).json()["id"]).json()["id"])


def finished_part(batch: Batch, line: int) -> None:
    part = {"line": line, "custom_id": f"req-{line - 1}", "ok": True, "prompt_tokens": 5, "completion_tokens": 3,
            "record": {"custom_id": f"req-{line - 1}", "response": {"status_code": 200, "body": {}}, "error": None}}
    storage().save(f"{batch.part_prefix}/00001-{line:06d}.jsonl", ContentFile(json.dumps(part).encode() + b"\n"))


def test_tick_hands_on_batches_whose_runner_stopped_beating(batch_setup, settings, enqueued):
    settings.INFEROPS_BATCH_STALE_S = 60
    now = timezone.now()
    statuses = ("in_progress", "cancelling", "finalizing", "completed")
    rows = {status: a_batch(batch_setup["every"]) for status in statuses}
    enqueued.clear()
    for status, batch in rows.items():
        Batch.objects.filter(pk=batch.pk).update(status=status, heartbeat_at=now - timedelta(seconds=120))
    fresh = a_batch(batch_setup["every"])
    Batch.objects.filter(pk=fresh.pk).update(status="in_progress", heartbeat_at=now - timedelta(seconds=5))
    enqueued.clear()
    resumed = runner.tick()["resumed"]
    assert sorted(resumed) == sorted(rows[s].pk for s in ("in_progress", "cancelling", "finalizing"))
    assert sorted(enqueued) == sorted(resumed)


def test_tick_enqueues_a_never_started_batch_again_only_after_ten_stale_periods(
        batch_setup, settings, enqueued, django_capture_on_commit_callbacks):
    settings.INFEROPS_BATCH_STALE_S = 60
    with django_capture_on_commit_callbacks(execute=True):
        waiting = a_batch(batch_setup["every"])  # validating, enqueued at creation, no runner yet
    assert enqueued == [waiting.pk] and Batch.objects.get(pk=waiting.pk).enqueued_at is not None
    Batch.objects.filter(pk=waiting.pk).update(enqueued_at=timezone.now() - timedelta(minutes=9))
    assert runner.tick()["resumed"] == []
    Batch.objects.filter(pk=waiting.pk).update(enqueued_at=timezone.now() - timedelta(minutes=11))
    assert runner.tick()["resumed"] == [waiting.pk]
    assert runner.tick()["resumed"] == []  # enqueued again just now: once per ten periods


def test_a_runner_that_died_while_finalizing_is_finished_by_the_next(batch_setup, settings):
    settings.INFEROPS_BATCH_STALE_S = 60
    batch = a_batch(batch_setup["every"])
    Batch.objects.filter(pk=batch.pk).update(status="finalizing", total=2, attempt=1, model="chat",
                                             in_progress_at=timezone.now(), finalizing_at=timezone.now(),
                                             heartbeat_at=timezone.now() - timedelta(seconds=120))
    finished_part(batch, 1)
    finished_part(batch, 2)
    assert runner.run_batch(batch.pk) == "completed"
    ended = Batch.objects.get(pk=batch.pk)
    assert (ended.status, ended.completed, ended.attempt) == ("completed", 2, 2)
    output = [json.loads(x) for x in read_lines(BatchFile.objects.get(pk=ended.output_file_id).storage_name)]
    assert [o["custom_id"] for o in output] == ["req-0", "req-1"]


def test_a_fresh_heartbeat_keeps_another_runner_off(batch_setup, settings):
    settings.INFEROPS_BATCH_STALE_S = 60
    batch = a_batch(batch_setup["every"])
    Batch.objects.filter(pk=batch.pk).update(status="in_progress", total=2, attempt=3, heartbeat_at=timezone.now())
    assert runner.claim(batch.pk) is None
    assert runner.run_batch(batch.pk) == "held by another runner"
    assert Batch.objects.get(pk=batch.pk).attempt == 3


def test_how_a_batch_ends_is_read_from_its_row(batch_setup):
    batch = a_batch(batch_setup["every"])
    batch.total, batch.expires_at = 2, timezone.now() + timedelta(hours=1)
    two, one = {"a": {}, "b": {}}, {"a": {}}
    assert runner.final_status(batch, two)[0] == "completed"
    assert runner.final_status(batch, one) is None
    batch.expires_at = timezone.now() - timedelta(seconds=1)
    assert runner.final_status(batch, one)[0] == "expired"
    batch.cancelling_at = timezone.now()
    assert runner.final_status(batch, two)[0] == "cancelled"
