from django.db import models


class DecisionKind(models.TextChoices):
    UP = "up", "Scale up"
    DOWN = "down", "Scale down"
    PARK = "park", "Park (scale to zero)"
    WAKE = "wake", "Wake (from zero)"
    BOUND = "bound", "Back within bounds"


class CurveSource(models.TextChoices):
    BENCH = "bench", "inferops bench"
    CAPACITY_RUN = "capacity-run", "Capacity run"


class RunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


ACTIVE_RUN = (RunStatus.QUEUED, RunStatus.RUNNING)
