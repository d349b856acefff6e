"""Rows the replica-metrics tests share: a deployment with replicas, and hand-built metric rows."""

from __future__ import annotations

from deployments.choices import ReplicaState
from registry import services


def deployment_with_replicas(artifact_dir, *, replicas: int = 2, name: str = "chat",
                             versions: int = 1):
    """A registered model with `versions` versions, a deployment of the first, and `replicas`
    ready replicas spread round-robin over the versions. Returns (deployment, versions, replicas).
    """
    from deployments.models import Deployment, Replica

    model = services.model_create(name=f"{name}-model", task="generate", actor=None)
    registered = [services.version_register(model=model, artifact_uri=str(artifact_dir), actor=None)
                  for _ in range(versions)]
    deployment = Deployment.objects.create(name=name, model=model, version=registered[0])
    rows = [
        Replica.objects.create(deployment=deployment, version=registered[i % versions],
                               node="test", url=f"http://127.0.0.1:9/{i}",
                               state=ReplicaState.READY)
        for i in range(replicas)
    ]
    return deployment, registered, rows


def metrics_row(model, replica, start, **fields):
    """Create a minute or hour row for `replica` at `start` with the given columns."""
    return model.objects.create(replica=replica, deployment_id=replica.deployment_id,
                                version_id=replica.version_id, start=start, **fields)
