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
    PARKED = "parked", "Parked"               # scaled to zero by its autoscaler; a request wakes it
    DELETING = "deleting", "Deleting"


class Strategy(models.TextChoices):
    CANARY = "canary", "Canary"
    BLUE_GREEN = "blue-green", "Blue-green"


class RolloutStatus(models.TextChoices):
    PROGRESSING = "progressing", "Progressing"
    PAUSED = "paused", "Paused"        # a pause step, an inconclusive analysis, or waiting for promote
    SUCCEEDED = "succeeded", "Succeeded"
    ABORTED = "aborted", "Aborted"
    ROLLED_BACK = "rolled_back", "Rolled back"  # succeeded, then the platform undid it during its watch


ACTIVE_ROLLOUT = (RolloutStatus.PROGRESSING, RolloutStatus.PAUSED)


class Verdict(models.TextChoices):
    RUNNING = "running", "Running"      # window not over, nothing failed yet
    PASS = "pass", "Pass"
    FAIL = "fail", "Fail"
    INCONCLUSIVE = "inconclusive", "Inconclusive"

class ReplicaState(models.TextChoices):
    PENDING = "pending", "Pending"      # row exists, process not started yet (or backing off)
    STARTING = "starting", "Starting"   # process started, /health not yet 200
    READY = "ready", "Ready"            # /health 200: routable
    DRAINING = "draining", "Draining"   # SIGTERM sent; finishing in-flight requests
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"         # died or never became ready; will be replaced

    @classmethod
    def live(cls) -> list[str]:
        return [cls.PENDING, cls.STARTING, cls.READY]
