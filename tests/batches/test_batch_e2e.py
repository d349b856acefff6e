"""Issue 41 end to end, every part real: the official `openai` client through a gateway process
(which forwards /v1/files and /v1/batches to the control plane, here pytest-django's live server),
a Celery worker process with beat that runs the batches, replica processes of a chat and an
embeddings deployment, Redis, Postgres and the usage ledger.

- a 500-line chat batch whose worker is SIGKILLed at half way: a new worker resumes it, and the
  output has each custom_id exactly once; the ledger bills each line once;
- a 1,000-line embeddings batch; cancel keeps what finished and runs no more;
- keys and tenants at the gateway.
"""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from batches.models import Batch
from deployments.models import Replica
from deployments.replicas.drivers.local import LocalProcessDriver
from tenants.ingest import ingest_usage
from tenants.models import UsageEvent
from tenants.publish import publish_keys
from tests.batches.conftest import chat_lines, embedding_lines
from tests.deployments.test_reconcile import all_ready, reconcile_until
from tests.e2e.conftest import start_gateway
from tests.processes import stop_process
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]


@pytest.fixture
def platform(batch_setup, private_redis, live_server, worker_env, tmp_path, settings):
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.5, "health_timeout_s": 1}
    reconcile_until(batch_setup["chat"], all_ready(1))
    reconcile_until(batch_setup["embed"], all_ready(1))
    publish_keys()
    env = {**worker_env, "REDIS_URL": private_redis.url, "INFEROPS_BATCH_STALE_S": "3", "INFEROPS_BATCH_TICK_S": "1"}
    workers = [start_worker(env, tmp_path, "worker-1")]
    gateway, base = start_gateway(private_redis.url, tmp_path / "spool",
                                  {"INFEROPS_CONTROL_PLANE_URL": live_server.url})

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)

    yield {**batch_setup, "client": client, "workers": workers, "env": env, "tmp": tmp_path}
    stop_process(gateway)
    for worker in workers:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    for replica in Replica.objects.all():
        LocalProcessDriver().kill(replica)


def run_to_end(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> openai.types.Batch:
    def ended():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None
    return wait_until(ended, lambda: f"batch {batch_id} to end: {Batch.objects.filter(pk=batch_id).values()}",
                      timeout, 0.5)


def output_lines(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def test_a_chat_batch_whose_worker_is_killed_half_way_finishes_with_each_line_once(platform):
    client = platform["client"](platform["every"])
    upload = client.files.create(file=("chat.jsonl", chat_lines(500)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.request_counts.total == 0
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 250,
               lambda: f"half the batch: {Batch.objects.filter(pk=batch.id).values()}", 300, 0.1)
    first = platform["workers"][0]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = client.batches.retrieve(batch.id).request_counts.completed
    platform["workers"].append(start_worker(platform["env"], platform["tmp"], "worker-2"))
    done = run_to_end(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == done.request_counts.completed == 500 and done.error_file_id is None
    assert Batch.objects.get(pk=batch.id).attempt >= 2  # resumed by another attempt
    results = output_lines(client, done.output_file_id)
    ids = [result["custom_id"] for result in results]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(500)) and len(set(ids)) == 500
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"] for r in results)
    # Billed once per line, at batch priority, whatever ran twice across the kill.
    wait_until(lambda: ingest_usage(budget_s=5) is not None and
               UsageEvent.objects.filter(batch_id=batch.id).count() == 500, "the ledger to have every line", 60, 0.5)
    events = UsageEvent.objects.filter(batch_id=batch.id)
    assert set(events.values_list("priority", flat=True)) == {-1000}
    assert sum(events.values_list("completion_tokens", flat=True)) == done.usage.output_tokens
    print(f"worker killed at {killed_at}/500 finished lines; resumed and completed")


def test_an_embeddings_batch_runs_whole_and_a_cancelled_batch_keeps_what_finished(platform):
    client = platform["client"](platform["every"])
    upload = client.files.create(file=("docs.jsonl", embedding_lines(1000)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    done = run_to_end(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1000, done
    results = output_lines(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"doc-{i}" for i in range(1000))
    assert all(len(r["response"]["body"]["data"][0]["embedding"]) == 384 for r in results)

    long_lines = chat_lines(400, max_tokens=48)
    cancelled = client.batches.create(
        input_file_id=client.files.create(file=("long.jsonl", long_lines), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(cancelled.id).request_counts.completed >= 5, "some lines", 120, 0.1)
    assert client.batches.cancel(cancelled.id).status == "cancelling"
    at_cancel = client.batches.retrieve(cancelled.id).request_counts.completed
    ended = run_to_end(client, cancelled.id, timeout=60)
    assert ended.status == "cancelled" and ended.cancelled_at
    # No new line starts after the cancel: only those already in flight (at most a window each) finish.
    finished = ended.request_counts.completed
    assert at_cancel <= finished <= at_cancel + 32 < 400
    assert len(output_lines(client, ended.output_file_id)) == finished
    time.sleep(2)
    assert client.batches.retrieve(cancelled.id).request_counts.completed == finished


def test_the_gateway_enforces_keys_and_tenants_on_files_and_batches(platform):
    mine = platform["client"](platform["chat_only"])
    upload = mine.files.create(file=("e.jsonl", embedding_lines(3)), purpose="batch")
    batch = mine.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = run_to_end(mine, batch.id, timeout=60)
    assert failed.status == "failed" and {e.code for e in failed.errors.data} == {"model_not_allowed"}
    with pytest.raises(openai.AuthenticationError):
        platform["client"]("iop_not_a_key").batches.list()
    with pytest.raises(openai.NotFoundError):
        platform["client"](platform["rival_key"]).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        platform["client"](platform["rival_key"]).files.content(upload.id)
