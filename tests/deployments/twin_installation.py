"""A second inferops installation, driven from the command line by test_two_installations.py.

Run with the twin's own DATABASE_URL, REDIS_URL and INFEROPS_DATA_DIR in the environment, and
TWIN_DEPLOYMENT naming its deployment (unique per run, so a route left in a shared Redis by an
earlier run can never pass for this one's):

    python -m tests.deployments.twin_installation deploy CHECKPOINT   # the deployment, 1 replica, ready
    python -m tests.deployments.twin_installation kill                # SIGKILL its replica; ready again
    python -m tests.deployments.twin_installation scale-to-zero       # drained and stopped

Each prints its replica as JSON ({"id", "pid", "start_time"}, or {} when none runs).
"""

from __future__ import annotations

import json
import os
import sys

from tests.waiting import wait_until

DEPLOYMENT = os.environ.get("TWIN_DEPLOYMENT", "twin")


def reconcile_until(predicate, timeout: float = 90) -> None:
    from deployments.models import Deployment
    from deployments.replicas.reconcile import reconcile_deployment

    deployment = Deployment.objects.get(name=DEPLOYMENT)

    def converged() -> bool:
        if predicate():
            return True
        reconcile_deployment(deployment.pk)
        return False

    replicas = deployment.replica_set.values("pk", "state", "last_error")
    wait_until(converged, lambda: f"twin: convergence: {list(replicas)}", timeout, 0.3)


def live():
    from deployments.choices import ReplicaState
    from deployments.models import Replica

    return list(Replica.objects.filter(deployment__name=DEPLOYMENT).exclude(state=ReplicaState.STOPPED))


def ready() -> bool:
    return [r.state for r in live()] == ["ready"]


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.conf import settings

    from deployments import services as deployment_services
    from deployments.models import Deployment
    from deployments.replicas.drivers.local import LocalProcessDriver
    from registry import services as registry_services

    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.2, "backoff_base_s": 0.2}
    command = argv[0]
    if command == "deploy":
        model = registry_services.model_create(name="tiny", task="generate", actor=None)
        registry_services.version_register(model=model, artifact_uri=argv[1], actor=None)
        deployment_services.deployment_create(name=DEPLOYMENT, model=model, version=1, replicas=1, actor=None)
        reconcile_until(ready)
    elif command == "kill":
        replica = live()[0]
        LocalProcessDriver().kill(replica, why="the twin's own test")
        reconcile_until(lambda: ready() and live()[0].restarts == replica.restarts + 1)
    elif command == "scale-to-zero":
        deployment_services.deployment_update(deployment=Deployment.objects.get(name=DEPLOYMENT), actor=None,
                                              replicas=0)
        reconcile_until(lambda: not live())
    else:
        raise SystemExit(f"unknown command {command!r}")
    replicas = live()
    print(json.dumps({"id": replicas[0].pk, "pid": replicas[0].identity["pid"],
                      "start_time": replicas[0].identity["start_time"]} if replicas else {}))


if __name__ == "__main__":
    main(sys.argv[1:])
