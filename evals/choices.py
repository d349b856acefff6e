from django.db import models


class Scorer(models.TextChoices):
    EXACT = "exact", "Exact match"
    REGEX = "regex", "Regular expression"
    CHOICE = "choice", "Multiple choice (log-likelihood)"
    SIMILARITY = "similarity", "Embedding similarity"
    PARITY = "parity", "Parity with a reference version"


class RunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


FINISHED_RUN = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class TargetKind(models.TextChoices):
    DEPLOYMENT = "deployment", "A deployment's replicas"
    VERSION = "version", "A model version on a temporary replica"
    ROLLOUT = "rollout", "A rollout's candidate, through its preview route"


class Trigger(models.TextChoices):
    """Who asked for the run: a person or CI, a new version, a quality SLO's schedule, a rollout step."""

    API = "api", "API or CLI"
    CONSOLE = "console", "Console"
    REGISTER = "register", "Version registered"
    SLO = "slo", "Quality SLO schedule"
    ROLLOUT = "rollout", "Rollout quality step"
