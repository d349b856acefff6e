"""Deployment assets: docker-compose and the Kubernetes manifests run the processes `make run` runs."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_platform_is_not_a_python_package():
    # A package named `platform` would shadow the standard library module and break uuid/Django.
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_compose_runs_every_process_against_postgres_and_redis():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "web", "gateway", "worker", "beat"} <= set(services)
    for name in ("web", "gateway", "worker", "beat", "migrate"):
        env = services[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://") and env["REDIS_URL"].startswith("redis://")
    assert "uvicorn" in services["web"]["command"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "inferops.celery", "beat"]
    assert (ROOT / services["web"]["build"]["dockerfile"]).is_file()


def test_kubernetes_manifests_are_valid_objects():
    from kubernetes import client
    from kubernetes.client import ApiClient

    api = ApiClient()
    kinds = {"Deployment": "V1Deployment", "Service": "V1Service", "ConfigMap": "V1ConfigMap",
             "Secret": "V1Secret", "Job": "V1Job"}
    seen = []
    for path in sorted((ROOT / "platform" / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["apiVersion"] and document["metadata"]["name"]
            # Deserialising into the client's typed model rejects unknown shapes and wrong types.
            obj = api._ApiClient__deserialize(document, kinds[document["kind"]])
            seen.append((document["kind"], obj.metadata.name))
            if isinstance(obj, client.V1Deployment):
                selector = obj.spec.selector.match_labels
                assert selector.items() <= obj.spec.template.metadata.labels.items()
    beat = next(d for d in yaml.safe_load_all((ROOT / "platform/kubernetes/beat.yaml").read_text()))
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    assert {name for _, name in seen} >= {"inferops-web", "inferops-gateway", "inferops-worker", "inferops-beat"}
