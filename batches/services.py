"""Files and batches: upload, validate, create, cancel, expire and finalize.

A file's bytes go to the `batch_files` storage (settings.STORAGES), never into a row. Creating a
batch enqueues the runner after the commit; the runner validates every line first (batches.lines)
and only then spends tokens (batches.runner). The state changes are conditional UPDATEs, so a
cancel racing the runner, or two runners, leave one answer.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta

from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.core.files.base import ContentFile, File
from django.core.files.storage import storages
from django.db import transaction
from django.utils import timezone

from batches.choices import ACTIVE_BATCH, COMPLETION_WINDOWS, ENDPOINTS, BatchStatus, FilePurpose
from batches.lines import MAX_ERRORS_SHOWN, Checked, LineError, check_lines
from batches.models import Batch, BatchFile
from deployments.models import Deployment
from inferops.celery import enqueue
from registry.choices import Task
from tenants.models import ApiKey

RUN_TASK = "batches.run_batch"
MAX_METADATA_PAIRS = 16


class BatchError(Exception):
    """A request the Files or Batches API refuses: OpenAI's status, type, param and code."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.error_type = status, param, code, error_type


def storage():
    return storages["batch_files"]


# What a folder or a bucket raises when it cannot be written or read: full, read-only, unreachable, denied.
STORAGE_ERRORS = (OSError, BotoCoreError, ClientError)


def storage_unavailable(exc: Exception) -> BatchError:
    return BatchError(f"The batch file storage cannot be used ({type(exc).__name__}: {exc}); an operator should "
                      "check INFEROPS_BATCH_FILES_URL and its folder or bucket.", status=503,
                      error_type="server_error", code="storage_unavailable")


def owned(model: type[BatchFile] | type[Batch], key: ApiKey, pk: str, param: str):
    """The tenant's file or batch by id, or OpenAI's 404: another tenant's looks the same as none."""
    row = model.objects.filter(pk=pk, tenant_id=key.tenant_id).first()
    if row is None:
        noun = "file" if model is BatchFile else "batch"
        raise BatchError(f"No {noun} {pk!r} of yours exists.", status=404, param=param, error_type="not_found_error")
    return row


# -- files --------------------------------------------------------------------------------------


def file_create(*, key: ApiKey, upload: File, filename: str, purpose: str) -> BatchFile:
    if purpose != FilePurpose.BATCH:
        raise BatchError(f"`purpose` must be \"batch\" (got {purpose!r}): this server stores batch input files only.",
                         param="purpose")
    limit = settings.INFEROPS_BATCH_MAX_FILE_BYTES
    if upload.size > limit:
        raise BatchError(f"The file is {upload.size} bytes; the limit is {limit} bytes.", status=413, param="file")
    if not filename.endswith(".jsonl"):
        raise BatchError("A batch input file must be JSONL, named *.jsonl.", param="file")
    row = BatchFile(tenant_id=key.tenant_id, key_prefix=key.prefix, purpose=purpose, filename=filename[:255],
                    bytes=upload.size)
    row.lines = sum(1 for line in _chunks_to_lines(upload.chunks()) if line.strip())
    upload.seek(0)
    try:
        row.storage_name = storage().save(f"files/{row.id}.jsonl", upload)
    except STORAGE_ERRORS as exc:
        raise storage_unavailable(exc) from exc
    row.save()
    return row


def stored_file(*, content: bytes, tenant_id: int, key_prefix: str, filename: str) -> BatchFile:
    """An output or error file the runner wrote."""
    row = BatchFile(tenant_id=tenant_id, key_prefix=key_prefix, purpose=FilePurpose.BATCH_OUTPUT, filename=filename,
                    bytes=len(content), lines=content.count(b"\n"))
    row.storage_name = storage().save(f"files/{row.id}.jsonl", ContentFile(content))
    row.save()
    return row


def file_delete(*, file: BatchFile) -> None:
    if Batch.objects.filter(input_file=file, status__in=ACTIVE_BATCH).exists():
        raise BatchError(f"File {file.id} is the input of a batch still running; cancel the batch or wait for it "
                         "to end, then delete the file.", status=409, param="file_id")
    try:
        storage().delete(file.storage_name)
    except STORAGE_ERRORS as exc:
        raise storage_unavailable(exc) from exc
    file.delete()


def read_lines(name: str) -> Iterator[bytes]:
    with storage().open(name, "rb") as handle:
        yield from _chunks_to_lines(handle.chunks())


def _chunks_to_lines(chunks) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        yield from lines
    if rest:
        yield rest


# -- batches ------------------------------------------------------------------------------------


def batch_create(*, key: ApiKey, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict | None) -> Batch:
    if endpoint not in ENDPOINTS:
        raise BatchError(f"`endpoint` must be one of {', '.join(ENDPOINTS)} (got {endpoint!r}).", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchError(f"`completion_window` must be one of {', '.join(COMPLETION_WINDOWS)} "
                         f"(got {completion_window!r}).", param="completion_window")
    _check_metadata(metadata)
    file = owned(BatchFile, key, input_file_id, "input_file_id")
    if file.purpose != FilePurpose.BATCH:
        raise BatchError(f"File {file.id} has purpose {file.purpose!r}; a batch's input needs purpose \"batch\".",
                         param="input_file_id")
    with transaction.atomic():
        batch = Batch.objects.create(
            tenant_id=key.tenant_id, api_key=key, key_prefix=key.prefix, endpoint=endpoint,
            completion_window=completion_window, metadata=metadata, input_file=file, input_file_ref=file.id,
            expires_at=timezone.now() + timedelta(seconds=COMPLETION_WINDOWS[completion_window]))
        transaction.on_commit(lambda: enqueue_run(batch.pk))
    return batch


def enqueue_run(batch_id: str) -> None:
    Batch.objects.filter(pk=batch_id).update(enqueued_at=timezone.now())
    enqueue(RUN_TASK, batch_id)


def _check_metadata(metadata) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise BatchError(f"`metadata` must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys up to 64 "
                         "characters, values up to 512).", param="metadata")


def batch_cancel(*, batch: Batch) -> Batch:
    """Ask the runner to stop: it starts no new line, keeps the finished ones and ends `cancelled`.
    A batch still validating, or whose runner is gone, is cancelled here at once."""
    now = timezone.now()
    moved = Batch.objects.filter(pk=batch.pk, status__in=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)).update(
        status=BatchStatus.CANCELLING, cancelling_at=now)
    batch.refresh_from_db()
    if not moved and batch.status != BatchStatus.CANCELLING:
        raise BatchError(f"Batch {batch.id} is {batch.status}; only a validating or in-progress batch can be "
                         "cancelled.", status=409, param="batch_id")
    transaction.on_commit(lambda: enqueue_run(batch.pk))  # a batch no runner holds ends at once
    return batch


def validate(batch: Batch) -> Checked:
    """Check the input file's lines against the batch's endpoint and key (see batches.lines)."""
    if batch.input_file is None:
        return Checked(errors=[LineError(1, "missing_file", f"The input file {batch.input_file_ref} was deleted.")])
    key = batch.api_key
    return check_lines(read_lines(batch.input_file.storage_name), batch.endpoint,
                       max_lines=settings.INFEROPS_BATCH_MAX_LINES,
                       model_problem=lambda name: model_problem(name, batch.endpoint, key))


def model_problem(name: str, endpoint: str, key: ApiKey | None) -> tuple[str, str] | None:
    if key is None or key.state != "active":
        return "invalid_api_key", "The batch's API key was revoked or has expired."
    if key.deployments and name not in key.deployments:
        return "model_not_allowed", f"API key {key.prefix} may not use the deployment `{name}`."
    deployment = Deployment.objects.filter(name=name, deleted_at__isnull=True).select_related("model").first()
    if deployment is None:
        return "model_not_found", f"The deployment `{name}` does not exist."
    wanted = Task.EMBED if ENDPOINTS[endpoint] == "embeddings" else Task.GENERATE
    if deployment.model.task != wanted:
        return "invalid_model", (f"The deployment `{name}` serves {deployment.model.get_task_display().lower()}; "
                                 f"{endpoint} needs a {wanted.label.lower()} model.")
    return None


def fail_validation(batch: Batch, checked: Checked) -> None:
    """The batch fails before any token is spent: its `errors` and an error file naming each bad line."""
    content = b"".join(json.dumps(e.as_error_line()).encode() + b"\n" for e in checked.errors)
    with transaction.atomic():
        error_file = stored_file(content=content, tenant_id=batch.tenant_id, key_prefix=batch.key_prefix,
                                 filename=f"{batch.id}_validation_errors.jsonl")
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.FAILED, failed_at=timezone.now(), error_file=error_file, total=checked.lines,
            errors={"object": "list", "data": [e.as_openai() for e in checked.errors[:MAX_ERRORS_SHOWN]]})


def jsonl(records) -> bytes:
    out = io.BytesIO()
    for record in records:
        out.write(json.dumps(record, separators=(",", ":")).encode())
        out.write(b"\n")
    return out.getvalue()
