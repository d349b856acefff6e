from django.db import models


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
