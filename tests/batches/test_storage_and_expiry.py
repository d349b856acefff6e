"""Batch files live in a storage backend, never in rows: a local folder by default, an S3-compatible
bucket by setting. The S3 case runs against moto's S3 server, a real HTTP S3 API in this process (no
bucket is reachable from this machine), through the same django-storages backend production uses.

Both backends carry the same run: a batch resumes from a part file an earlier attempt left, and one
past its completion window expires with its partial output and an error line for each request it
never ran."""

from __future__ import annotations

import json
from datetime import timedelta

import boto3
import pytest
from django.core.files.base import ContentFile
from django.utils import timezone

from batches import runner
from batches.models import Batch, BatchFile
from batches.services import read_lines, storage
from tests.batches.conftest import chat_lines
from tests.batches.test_openai_api import client_for, create_batch, upload
from tests.conftest import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def s3_storage(settings, monkeypatch):
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    bucket = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket.create_bucket(Bucket="inferops-batches")
    from project.settings import batch_files_storage

    monkeypatch.setenv("INFEROPS_S3_ENDPOINT_URL", endpoint)
    settings.STORAGES = {**settings.STORAGES, "batch_files": batch_files_storage("s3://inferops-batches/prod")}
    yield bucket
    server.stop()


def bucket_keys(bucket) -> list[str]:
    return sorted(item["Key"] for item in bucket.list_objects_v2(Bucket="inferops-batches").get("Contents", []))


def resume_then_expire(key: str) -> tuple[dict, list[dict], list[dict]]:
    """A 3-line batch whose first line an earlier attempt finished; its window ends before the rest run."""
    client = client_for(key)
    batch_id = create_batch(client, upload(client, chat_lines(3)).json()["id"]).json()["id"]
    batch = Batch.objects.get(pk=batch_id)
    earlier = {"line": 1, "custom_id": "req-0", "ok": True, "prompt_tokens": 7, "completion_tokens": 4,
               "record": {"id": "batch_req_x", "custom_id": "req-0", "response": {"status_code": 200, "body": {}},
                          "error": None}}
    storage().save(f"{batch.part_prefix}/00001-000001.jsonl", ContentFile(json.dumps(earlier).encode() + b"\n"))
    Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert runner.run_batch(batch_id) == "expired"
    ended = client.get(f"/v1/batches/{batch_id}").json()
    outputs = [json.loads(x) for x in read_lines(BatchFile.objects.get(pk=ended["output_file_id"]).storage_name)]
    errors = [json.loads(x) for x in read_lines(BatchFile.objects.get(pk=ended["error_file_id"]).storage_name)]
    assert not storage().listdir(batch.part_prefix)[1]  # the parts are gone once the files are written
    return ended, outputs, errors


def check_expired(ended: dict, outputs: list[dict], errors: list[dict]) -> None:
    assert ended["status"] == "expired" and ended["expired_at"] and ended["in_progress_at"]
    assert ended["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert ended["usage"]["input_tokens"] == 7  # the earlier attempt's tokens count
    assert [o["custom_id"] for o in outputs] == ["req-0"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("req-1", "batch_expired"),
                                                                       ("req-2", "batch_expired")]


def test_a_local_folder_holds_the_files_and_an_expired_batch_keeps_its_partial_output(batch_setup, batch_storage):
    check_expired(*resume_then_expire(batch_setup["every"]))
    assert len(list((batch_storage / "files").iterdir())) == 3  # input, output, errors


def test_an_s3_bucket_holds_the_files_and_an_expired_batch_keeps_its_partial_output(batch_setup, s3_storage):
    check_expired(*resume_then_expire(batch_setup["every"]))
    keys = bucket_keys(s3_storage)
    assert len(keys) == 3 and all(key.startswith("prod/files/file-") for key in keys), keys
    # What the API serves comes from the bucket.
    row = BatchFile.objects.filter(purpose="batch").get()
    body = s3_storage.get_object(Bucket="inferops-batches", Key=f"prod/{row.storage_name}")["Body"].read()
    download = client_for(batch_setup["every"]).get(f"/v1/files/{row.id}/content")
    assert b"".join(download.streaming_content) == body == chat_lines(3)


def test_the_storage_setting_refuses_what_it_cannot_use():
    from inferops.env import ImproperlyConfiguredEnv
    from project.settings import batch_files_storage

    for url in ("http://bucket", "s3://", "gs://bucket/x"):
        with pytest.raises(ImproperlyConfiguredEnv):
            batch_files_storage(url)
