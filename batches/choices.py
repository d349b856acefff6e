from django.db import models


class BatchStatus(models.TextChoices):
    """OpenAI's batch statuses, in the order a batch goes through them."""

    VALIDATING = "validating", "Validating"
    FAILED = "failed", "Failed"
    IN_PROGRESS = "in_progress", "In progress"
    FINALIZING = "finalizing", "Finalizing"
    COMPLETED = "completed", "Completed"
    EXPIRED = "expired", "Expired"
    CANCELLING = "cancelling", "Cancelling"
    CANCELLED = "cancelled", "Cancelled"


FINISHED_BATCH = (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)
ACTIVE_BATCH = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


class FilePurpose(models.TextChoices):
    BATCH = "batch", "Batch input"
    BATCH_OUTPUT = "batch_output", "Batch output"


# The endpoints a batch may run, and the gateway's name for each (the usage event's `endpoint`).
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
