"""Batch files and batches, as OpenAI's Batch API defines them.

A file's bytes live in the `batch_files` storage (a local folder, or an S3-compatible bucket by
setting), never in a row: the row holds what the API shows and where the bytes are. A batch row
holds its state, counts, tokens and timestamps; its progress lives in the storage too, as part
files the runner writes (batches/runner.py), so a batch resumes from there after a worker dies.
"""

from __future__ import annotations

import secrets

from django.db import models

from batches.choices import BatchStatus, FilePurpose


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class BatchFile(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="batch_files")
    key_prefix = models.CharField(max_length=8, help_text="The API key that uploaded it (or its batch's).")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    storage_name = models.CharField(max_length=255, help_text="Where its bytes are in the batch_files storage.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.id} {self.filename}"


class Batch(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="batches")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, on_delete=models.SET_NULL, related_name="+")
    key_prefix = models.CharField(max_length=8)
    endpoint = models.CharField(max_length=32)
    completion_window = models.CharField(max_length=8)
    metadata = models.JSONField(null=True, blank=True)
    # The deployment every line names (OpenAI: one model per batch); set by validation.
    model = models.CharField(max_length=63, blank=True)
    status = models.CharField(max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    input_file = models.ForeignKey(BatchFile, null=True, on_delete=models.SET_NULL, related_name="+")
    input_file_ref = models.CharField(max_length=40, help_text="The input file's id, kept if it is deleted.")
    output_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    errors = models.JSONField(null=True, blank=True, help_text="Why validation failed: OpenAI's errors list.")
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The runner's claim: which attempt holds it, and when it last said so (a stale beat is resumed).
    attempt = models.PositiveIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(null=True, blank=True, help_text="When its runner task was last queued.")
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def finished(self) -> int:
        return self.completed + self.failed

    @property
    def part_prefix(self) -> str:
        """The storage folder of this batch's progress: one part file per flush of finished lines."""
        return f"batches/{self.id}/parts"
