"""Deployment assets: docker-compose and the Kubernetes manifests run the processes `make run` runs.

Kubernetes manifests (the kustomize base and overlay, and what the Kubernetes driver generates)
are validated with kubernetes-validate against the OpenAPI schemas of a pinned Kubernetes
version, in strict mode, so an unknown or misspelt field fails as the API server would refuse it.
No cluster is reachable here; the schemas ship with the package.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "platform" / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAY = KUBERNETES / "overlays" / "example"
KUBERNETES_VERSION = "1.33.0"
IMAGE_UID = 10001  # the `inferops` user of platform/Dockerfile
WORKLOADS = {"Deployment", "StatefulSet", "Job"}


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


def test_compose_runs_batches_on_a_worker_of_their_own_that_shares_the_files_with_web():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    command = services["batch-worker"]["command"]
    assert command[command.index("--queues") + 1] == "batches"
    assert "--queues" not in services["worker"]["command"]  # every other task, on the default queue
    files = "/var/lib/inferops/batch-files"  # the data directory's batch-files folder (platform/Dockerfile)
    for name in ("web", "batch-worker"):
        assert any(volume.endswith(f":{files}") for volume in services[name]["volumes"]), name


def test_kubernetes_runs_batches_on_a_worker_of_their_own_that_shares_the_files_with_web(rendered):
    _, documents = rendered
    pod = documents[("Deployment", "inferops-batch-worker")]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--queues") + 1] == "batches"
    claim = documents[("PersistentVolumeClaim", "inferops-batch-files")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for deployment in ("inferops-web", "inferops-batch-worker"):
        spec = documents[("Deployment", deployment)]["spec"]["template"]["spec"]
        volume = next(v["name"] for v in spec["volumes"]
                      if v.get("persistentVolumeClaim", {}).get("claimName") == "inferops-batch-files")
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts[volume] == "/var/lib/inferops/batch-files", deployment


def test_compose_gateway_forwards_files_and_batches_to_the_web_service():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    url = services["gateway"]["environment"]["INFEROPS_CONTROL_PLANE_URL"]
    web = services["web"]["command"]
    assert url == f"http://web:{web[web.index('--port') + 1]}"
    assert "web" in services["web"]["environment"]["ALLOWED_HOSTS"].split(",")  # the Host the gateway sends


# --- a minimal kustomize: what this repository's kustomizations use, nothing more ------------
# kubectl renders them when it is installed (and the two renders are compared below); without
# it the tests still render and validate every manifest.

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition"}
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches",
                "labels"}


def strategic_merge(target, patch):
    """Maps merge key by key; lists of named items (containers, volumes) merge by name."""
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            merged[key] = strategic_merge(target[key], value) if key in target else value
        return merged
    if (isinstance(target, list) and isinstance(patch, list)
            and all(isinstance(item, dict) and "name" in item for item in target + patch)):
        merged = [dict(item) for item in target]
        names = [item["name"] for item in merged]
        for item in patch:
            if item["name"] in names:
                index = names.index(item["name"])
                merged[index] = strategic_merge(merged[index], item)
            else:
                merged.append(item)
        return merged
    return copy.deepcopy(patch)


def pod_specs(document: dict) -> list[dict]:
    return [document["spec"]["template"]["spec"]] if document["kind"] in WORKLOADS else []


def containers(document: dict) -> list[dict]:
    return [container for spec in pod_specs(document)
            for container in spec.get("initContainers", []) + spec["containers"]]


def render_kustomization(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    assert not unknown, f"{directory}: the test's kustomize does not implement {sorted(unknown)}"
    documents: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        documents += (render_kustomization(path) if path.is_dir()
                      else [d for d in yaml.safe_load_all(path.read_text()) if d])
    for entry in kustomization.get("patches", []):
        patch = yaml.safe_load(entry["patch"])
        target = entry["target"]
        hits = [i for i, d in enumerate(documents)
                if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert hits, f"patch target {target} matches nothing"
        for index in hits:
            documents[index] = strategic_merge(documents[index], patch)
    for entry in kustomization.get("labels", []):
        for document in documents:
            document["metadata"].setdefault("labels", {}).update(entry["pairs"])
    if "namespace" in kustomization:
        for document in documents:
            if document["kind"] not in CLUSTER_SCOPED:
                document["metadata"]["namespace"] = kustomization["namespace"]
        # kustomize moves the bindings of the service accounts it moved, as kubectl does.
        accounts = {d["metadata"]["name"] for d in documents if d["kind"] == "ServiceAccount"}
        for document in documents:
            for subject in document.get("subjects", []) if document["kind"] == "RoleBinding" else []:
                if subject["kind"] == "ServiceAccount" and subject["name"] in accounts:
                    subject["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for document in documents:
            for container in containers(document):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    for entry in kustomization.get("replicas", []):
        for document in documents:
            if document["kind"] in WORKLOADS - {"Job"} and document["metadata"]["name"] == entry["name"]:
                document["spec"]["replicas"] = entry["count"]
    return documents


def by_identity(documents: list[dict]) -> dict[tuple[str, str], dict]:
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    assert len(keyed) == len(documents), "two objects share a kind and name"
    return keyed


RENDERS = {"base": BASE, "overlay": OVERLAY}


@pytest.fixture(scope="module", params=sorted(RENDERS))
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, by_identity(render_kustomization(RENDERS[request.param]))


def validation_errors(document: dict) -> list[str]:
    """What the pinned Kubernetes version's schema refuses in one object (strict: no unknown
    fields); empty when it is valid."""
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        return [f"{document['kind']}/{document['metadata'].get('name')} at {where}: {error.message}"]
    return []


# --- the layout ---------------------------------------------------------------------------


def test_kustomize_base_lists_every_manifest_and_no_flat_files_remain():
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert not list(KUBERNETES.glob("*.yaml")), "manifests belong in base/ or an overlay"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", sorted(RENDERS))
def test_the_tests_kustomize_renders_what_kubectl_renders(name):
    # Proves the in-test renderer (used where kubectl is missing) is faithful to kustomize.
    output = subprocess.run(["kubectl", "kustomize", str(RENDERS[name])], check=True,
                            capture_output=True, text=True, timeout=60).stdout
    assert by_identity(render_kustomization(RENDERS[name])) == \
        by_identity([d for d in yaml.safe_load_all(output) if d])


# --- schema validation --------------------------------------------------------------------


def test_every_rendered_manifest_is_valid_for_the_pinned_kubernetes(rendered):
    _, documents = rendered
    assert {kind for kind, _ in documents} >= {
        "ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim",
        "Deployment", "StatefulSet", "Service", "Job", "PodDisruptionBudget"}
    errors = [error for document in documents.values() for error in validation_errors(document)]
    assert errors == []


@pytest.mark.parametrize("misspell", ["contianers", "imagePulPolicy", "readinesProbe"])
def test_a_misspelt_field_is_refused(rendered, misspell):
    _, documents = rendered
    web = copy.deepcopy(documents[("Deployment", "inferops-web")])
    pod = web["spec"]["template"]["spec"]
    if misspell == "contianers":
        pod["contianers"] = pod.pop("containers")
    elif misspell == "imagePulPolicy":
        pod["containers"][0]["imagePulPolicy"] = "IfNotPresent"
    else:
        pod["containers"][0]["readinesProbe"] = pod["containers"][0].pop("readinessProbe")
    assert validation_errors(web), f"{misspell} passed the schema"


def test_a_wrong_type_is_refused():
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"port": "eighty"}]}}
    assert validation_errors(service)


def driver_specs():
    from deployments.replicas.drivers.base import ReplicaSpec

    gpu = {"gpu_type": "nvidia-h100", "gpu_count": 2, "cpu": "8", "memory": "64Gi"}
    return {
        "builtin-cpu": ReplicaSpec(deployment="chat", version=3, model_path="/models/llama/v3",
                                   backend="builtin", engine_args={"max_num_seqs": 16},
                                   resources={"cpu": "2", "memory": "8Gi"}),
        "vllm-gpu": ReplicaSpec(deployment="a" * 70, version=12, model_path="file:///models/big/v12",
                                backend="vllm", resources=gpu,
                                engine_args={"tensor_parallel_size": 2, "drain_timeout": 30,
                                             "enable_prefix_caching": False}),
        "no-resources": ReplicaSpec(deployment="embed", version=1, model_path="/models/e5",
                                    backend="builtin", engine_args={}, resources={}),
    }


@pytest.mark.parametrize("case", ["builtin-cpu", "vllm-gpu", "no-resources"])
@pytest.mark.parametrize("host_path", ["", "/srv/models"])
def test_driver_generated_manifests_are_valid_for_the_pinned_kubernetes(case, host_path):
    from deployments.replicas.drivers.kubernetes import INSTALLATION_LABEL, KubernetesSettings, ManifestRenderer

    renderer = ManifestRenderer(KubernetesSettings(models_host_path=host_path))
    spec = driver_specs()[case]
    installation = "0b6e2b0c-4f5e-4d8a-9a43-3c1f6c1b2d7e"
    for body in (renderer.deployment(spec, replicas=3, installation=installation),
                 renderer.service(spec.deployment, spec.version), renderer.admin_secret(installation)):
        # The driver adds the installation label before applying; validate what it sends.
        body["metadata"]["labels"][INSTALLATION_LABEL] = installation
        assert validation_errors(body) == []


# --- what the manifests must say ------------------------------------------------------------


def test_every_container_is_sized_pinned_and_locked_down(rendered):
    _, documents = rendered
    workloads = [d for d in documents.values() if d["kind"] in WORKLOADS]
    assert {d["metadata"]["name"] for d in workloads} == {
        "inferops-web", "inferops-worker", "inferops-batch-worker", "inferops-beat", "inferops-gateway",
        "inferops-migrate"}
    for document in workloads:
        pod = pod_specs(document)[0]
        context = pod["securityContext"]
        assert (context["runAsNonRoot"], context["runAsUser"]) == (True, IMAGE_UID)
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        for container in containers(document):
            name = f"{document['metadata']['name']}/{container['name']}"
            image, _, tag = container["image"].rpartition(":")
            assert image and tag and tag != "latest", f"{name}: image tag not pinned"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{name}: {kind}"
            secured = container["securityContext"]
            assert secured["allowPrivilegeEscalation"] is False
            assert secured["capabilities"]["drop"] == ["ALL"]
            assert secured["readOnlyRootFilesystem"] is True
            # A read-only root needs somewhere to write temporary files.
            tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in volumes[tmp["name"]]


def test_health_probes_use_the_real_endpoints(rendered):
    from project.urls import urlpatterns

    _, documents = rendered
    web = containers(documents[("Deployment", "inferops-web")])[0]
    assert web["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert any(str(pattern.pattern) == "healthz" for pattern in urlpatterns)
    gateway = containers(documents[("StatefulSet", "inferops-gateway")])[0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    source = (ROOT / "runtime/gateway/server.py").read_text()
    assert 'path == "/health" and method == "GET"' in source


def test_gateway_forwards_files_and_batches_to_the_web_service(rendered):
    _, documents = rendered
    gateway = containers(documents[("StatefulSet", "inferops-gateway")])[0]
    url = {e["name"]: e["value"] for e in gateway["env"]}["INFEROPS_CONTROL_PLANE_URL"]
    service = documents[("Service", "inferops-web")]
    assert url == f"http://{service['metadata']['name']}"
    assert [port["port"] for port in service["spec"]["ports"]] == [80]
    # The web app answers to that name (the Host the gateway sends).
    assert "inferops-web" in documents[("ConfigMap", "inferops")]["data"]["ALLOWED_HOSTS"].split(",")


def test_gateway_spool_survives_the_pod_and_a_disruption_budget_keeps_one(rendered):
    _, documents = rendered
    gateway = documents[("StatefulSet", "inferops-gateway")]
    container = containers(gateway)[0]
    spool_dir = container["command"][container["command"].index("--spool-dir") + 1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == spool_dir)
    claims = {claim["metadata"]["name"] for claim in gateway["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    budget = documents[("PodDisruptionBudget", "inferops-gateway")]
    assert budget["spec"]["minAvailable"] >= 1
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_worker_runs_as_the_account_the_role_binds_and_mounts_models_where_the_driver_maps_them(rendered):
    name, documents = rendered
    worker = documents[("Deployment", "inferops-worker")]
    account = worker["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in documents
    binding = documents[("RoleBinding", account)]
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    assert ("Role", binding["roleRef"]["name"]) in documents
    config = documents[("ConfigMap", "inferops")]["data"]
    assert ("PersistentVolumeClaim", config["INFEROPS_K8S_MODELS_PVC"]) in documents
    for deployment in ("inferops-web", "inferops-worker"):
        pod = documents[("Deployment", deployment)]["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
        assert volume["persistentVolumeClaim"]["claimName"] == config["INFEROPS_K8S_MODELS_PVC"]
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
        # The control plane sees checkpoints at MODELS_ROOT; replica pods at MODELS_MOUNT.
        assert mount["mountPath"] == config["INFEROPS_K8S_MODELS_ROOT"]
    if name == "overlay":
        namespace = documents[("Namespace", "inferops-example")]["metadata"]["name"]
        assert config["INFEROPS_K8S_NAMESPACE"] == namespace
        assert all(d["metadata"]["namespace"] == namespace for (kind, _), d in documents.items()
                   if kind != "Namespace")


def test_beat_runs_exactly_once():
    beat = by_identity(render_kustomization(OVERLAY))[("Deployment", "inferops-beat")]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
