from django.db import models


class Backend(models.TextChoices):
    BUILTIN = "builtin", "Built-in engine"
    VLLM = "vllm", "vLLM"


class DriverName(models.TextChoices):
    LOCAL = "local", "Local processes"
    KUBERNETES = "kubernetes", "Kubernetes"


class DeploymentStatus(models.TextChoices):
    PENDING = "pending", "Pending"            # nothing ready yet
    PROGRESSING = "progressing", "Progressing"  # scaling or replacing replicas
    READY = "ready", "Ready"                  # desired replicas of the pinned version ready
    DEGRADED = "degraded", "Degraded"         # some ready, some failing
    FAILED = "failed", "Failed"               # none ready and replicas crash-looping
    PAUSED = "paused", "Paused"               # reconciliation paused by an operator
    DELETING = "deleting", "Deleting"
