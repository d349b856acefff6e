"""The Files and Batches API on the control plane (the gateway forwards /v1/files* and /v1/batches*
here; tests/batches/test_batch_e2e.py goes through it): uploads, listing, validation before any token
is spent, keys and tenants, cancel, and the nasty inputs. Validation runs in-process here
(batches.runner.run_batch); no replica is needed because a failing file never reaches one."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from batches import runner
from batches.models import Batch, BatchFile
from batches.services import read_lines, storage
from tests.batches.conftest import chat_lines, embedding_lines

pytestmark = pytest.mark.django_db


def client_for(key: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def upload(client: Client, content: bytes, name: str = "input.jsonl", purpose: str = "batch"):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return client.post("/v1/files", {"file": SimpleUploadedFile(name, content), "purpose": purpose})


def create_batch(client: Client, file_id: str, endpoint: str = "/v1/chat/completions", **extra):
    return client.post("/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": endpoint,
                                                  "completion_window": "24h", **extra}),
                       content_type="application/json")


def test_a_file_uploads_lists_reads_back_and_deletes(batch_setup):
    client = client_for(batch_setup["every"])
    content = chat_lines(3)
    created = upload(client, content).json()
    assert (created["object"], created["purpose"], created["bytes"], created["filename"]) == \
        ("file", "batch", len(content), "input.jsonl")
    row = BatchFile.objects.get(pk=created["id"])
    assert row.lines == 3 and storage().exists(row.storage_name)  # the bytes are in the storage, not a row
    assert client.get(f"/v1/files/{created['id']}").json() == created
    listed = client.get("/v1/files").json()
    assert [f["id"] for f in listed["data"]] == [created["id"]] and listed["has_more"] is False
    download = client.get(f"/v1/files/{created['id']}/content")
    assert b"".join(download.streaming_content) == content
    assert client.delete(f"/v1/files/{created['id']}").json() == {"id": created["id"], "object": "file",
                                                                   "deleted": True}
    assert not storage().exists(row.storage_name)
    assert client.get(f"/v1/files/{created['id']}").status_code == 404


def test_lists_page_newest_first_with_after(batch_setup):
    client = client_for(batch_setup["every"])
    ids = [upload(client, chat_lines(1)).json()["id"] for _ in range(3)]
    first = client.get("/v1/files?limit=2").json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = client.get(f"/v1/files?limit=2&after={first['last_id']}").json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    oldest = client.get("/v1/files?limit=2&order=asc").json()
    assert [f["id"] for f in oldest["data"]] == ids[:2] and oldest["has_more"] is True
    assert [f["id"] for f in client.get(f"/v1/files?order=asc&after={oldest['last_id']}").json()["data"]] == ids[2:]
    assert client.get("/v1/files?order=sideways").status_code == 400
    assert client.get("/v1/files?limit=0").status_code == 400
    assert client.get("/v1/files?after=file-nope").status_code == 400


def test_no_key_a_bad_key_and_a_revoked_key_get_401_in_openai_shape(batch_setup):
    for client in (Client(), client_for("iop_nope"), client_for(batch_setup["revoked"])):
        response = client.get("/v1/batches")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_a_tenant_sees_only_its_own_files_and_batches(batch_setup):
    mine = client_for(batch_setup["every"])
    file_id = upload(mine, chat_lines(2)).json()["id"]
    batch_id = create_batch(mine, file_id).json()["id"]
    rival = client_for(batch_setup["rival_key"])
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch_id}"):
        assert rival.get(path).status_code == 404, path
    assert rival.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
    assert create_batch(rival, file_id).status_code == 404  # nor run another tenant's file
    assert rival.get("/v1/batches").json()["data"] == []
    # Another key of the same tenant sees them: files and batches belong to the tenant.
    assert client_for(batch_setup["chat_only"]).get(f"/v1/batches/{batch_id}").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"endpoint": "/v1/images", "completion_window": "24h"}, "endpoint"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "1h"}, "completion_window"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"k": 1}}, "metadata"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {str(i): "v" for i in range(17)}},
     "metadata"),
    ({"endpoint": 5, "completion_window": "24h"}, "endpoint"),
])
def test_bad_batch_requests_are_refused_with_the_field_named(batch_setup, body, param):
    client = client_for(batch_setup["every"])
    file_id = upload(client, chat_lines(1)).json()["id"]
    response = client.post("/v1/batches", json.dumps({"input_file_id": file_id, **body}),
                           content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert not Batch.objects.exists()


def test_malformed_bodies_and_uploads_are_refused(batch_setup):
    client = client_for(batch_setup["every"])
    assert client.post("/v1/batches", b"{nope", content_type="application/json").status_code == 400
    assert client.post("/v1/batches", b"[1]", content_type="application/json").status_code == 400
    assert create_batch(client, "file-missing").status_code == 404
    assert upload(client, chat_lines(1), purpose="fine-tune").json()["error"]["param"] == "purpose"
    assert upload(client, chat_lines(1), name="input.csv").status_code == 400
    assert client.post("/v1/files", json.dumps({"file": "x"}), content_type="application/json").status_code == 400
    assert client.put("/v1/batches").status_code == 405
    assert not BatchFile.objects.exists()


def test_an_upload_over_the_limit_is_refused_before_it_is_stored(batch_setup, settings):
    settings.INFEROPS_BATCH_MAX_FILE_BYTES = 1000
    response = upload(client_for(batch_setup["every"]), chat_lines(50))
    assert response.status_code == 413 and not BatchFile.objects.exists()


def test_validation_fails_the_batch_with_an_error_file_naming_each_line_before_any_token(batch_setup):
    client = client_for(batch_setup["chat_only"])
    lines = chat_lines(3) + b"{broken\n" + chat_lines(1) + embedding_lines(1, model="chat").replace(
        b'"/v1/embeddings"', b'"/v1/embeddings"')
    file_id = upload(client, lines).json()["id"]
    batch = create_batch(client, file_id).json()
    assert batch["status"] == "validating"
    assert runner.run_batch(batch["id"]) == "failed validation"
    failed = client.get(f"/v1/batches/{batch['id']}").json()
    assert failed["status"] == "failed" and failed["failed_at"] and failed["in_progress_at"] is None
    codes = [(e["line"], e["code"]) for e in failed["errors"]["data"]]
    assert codes == [(4, "invalid_json_line"), (5, "duplicate_custom_id"), (6, "invalid_url")]
    error_lines = [json.loads(x) for x in read_lines(BatchFile.objects.get(pk=failed["error_file_id"]).storage_name)]
    assert [e["line"] for e in error_lines] == [4, 5, 6] and error_lines[1]["custom_id"] == "req-0"
    assert failed["request_counts"]["completed"] == 0 and failed["output_file_id"] is None


def test_a_key_may_not_batch_a_deployment_it_may_not_call(batch_setup):
    client = client_for(batch_setup["chat_only"])
    file_id = upload(client, embedding_lines(2)).json()["id"]
    batch_id = create_batch(client, file_id, endpoint="/v1/embeddings").json()["id"]
    runner.run_batch(batch_id)
    errors = client.get(f"/v1/batches/{batch_id}").json()["errors"]["data"]
    assert {e["code"] for e in errors} == {"model_not_allowed"} and len(errors) == 2


def test_unknown_and_wrong_task_models_fail_validation(batch_setup):
    client = client_for(batch_setup["every"])
    for lines, endpoint, code in ((chat_lines(1, model="ghost"), "/v1/chat/completions", "model_not_found"),
                                  (chat_lines(1, model="embed"), "/v1/chat/completions", "invalid_model"),
                                  (embedding_lines(1, model="chat"), "/v1/embeddings", "invalid_model")):
        batch_id = create_batch(client, upload(client, lines).json()["id"], endpoint=endpoint).json()["id"]
        runner.run_batch(batch_id)
        assert Batch.objects.get(pk=batch_id).errors["data"][0]["code"] == code


def test_a_batch_cancelled_while_validating_ends_cancelled_without_running(batch_setup):
    client = client_for(batch_setup["every"])
    batch_id = create_batch(client, upload(client, chat_lines(2)).json()["id"]).json()["id"]
    cancelling = client.post(f"/v1/batches/{batch_id}/cancel").json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    assert runner.run_batch(batch_id) == "cancelled"
    ended = client.get(f"/v1/batches/{batch_id}").json()
    assert ended["status"] == "cancelled" and ended["request_counts"]["completed"] == 0
    # A finished batch cannot be cancelled again.
    assert client.post(f"/v1/batches/{batch_id}/cancel").status_code == 409


def test_the_input_of_a_running_batch_cannot_be_deleted(batch_setup):
    client = client_for(batch_setup["every"])
    file_id = upload(client, chat_lines(2)).json()["id"]
    create_batch(client, file_id)
    response = client.delete(f"/v1/files/{file_id}")
    assert response.status_code == 409 and "cancel the batch" in response.json()["error"]["message"]


def test_batches_list_pages_and_carry_metadata(batch_setup):
    client = client_for(batch_setup["every"])
    file_id = upload(client, chat_lines(1)).json()["id"]
    ids = [create_batch(client, file_id, metadata={"run": str(i)}).json()["id"] for i in range(3)]
    page = client.get("/v1/batches?limit=2").json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    assert page["data"][0]["metadata"] == {"run": "2"}
    assert client.get(f"/v1/batches?after={page['last_id']}").json()["data"][0]["id"] == ids[0]


def test_a_storage_that_cannot_be_written_answers_503_and_leaves_no_row(batch_setup, settings, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder should be: no one, root included, can write below it")
    settings.STORAGES = {**settings.STORAGES, "batch_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": blocked / "files"}}}
    response = upload(client_for(batch_setup["every"]), chat_lines(2))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "storage_unavailable"
    assert "INFEROPS_BATCH_FILES_URL" in response.json()["error"]["message"]
    assert not BatchFile.objects.exists()


def test_a_file_whose_bytes_are_gone_answers_404_not_500(batch_setup):
    client = client_for(batch_setup["every"])
    created = upload(client, chat_lines(1)).json()
    storage().delete(BatchFile.objects.get(pk=created["id"]).storage_name)
    response = client.get(f"/v1/files/{created['id']}/content")
    assert response.status_code == 404 and "missing" in response.json()["error"]["message"]
