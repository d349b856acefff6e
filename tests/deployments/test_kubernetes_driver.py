"""Kubernetes driver: rendered manifests, and the API calls made with the real kubernetes client.

No cluster can be reached from this machine. The manifests are checked twice: by the client's own
typed models (strict pydantic models; a round trip back to a dict must give the same dict, so an
unknown or misspelt field fails) and by explicit assertions on what a cluster would reject or
mis-wire (selectors, port names, DNS labels, quantities). The API calls go through the real
kubernetes client to `FakeKubernetesApi`, an HTTP server in this process that stands in for the
cluster's API server: it records every request and answers like Kubernetes does (200/201 with
the object, 404 Status for missing objects, any status with a Status body on demand).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from django.utils import timezone
from kubernetes import client as k8s
from kubernetes.config import kube_config
from kubernetes.utils import parse_quantity

from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from deployments.replicas.drivers.base import DriverError, ReplicaSpec
from deployments.replicas.drivers.kubernetes import (
    APPLY_CONTENT_TYPE,
    INSTALLATION_LABEL,
    ClusterObjects,
    KubernetesDriver,
    KubernetesSettings,
    ManifestRenderer,
    model_path_in_pod,
    object_name,
)
from deployments.replicas.reconcile import Reconciler
from inferops.replica_admin import replica_admin_token
from registry import services
from registry.models import ModelVersion
from runtime.engine.server import add_arguments as builtin_server_arguments
from tests.conftest import free_port

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
H100 = {"gpu_type": "nvidia-h100", "gpu_count": 1, "cpu": "4", "memory": "16Gi"}
CPU_ONLY = {"cpu": "2", "memory": "8Gi"}


def make_spec(backend="builtin", resources=None, engine_args=None, deployment="chat", version=3,
              model_path="/models/llama-3-8b/v3") -> ReplicaSpec:
    return ReplicaSpec(deployment=deployment, version=version, model_path=model_path,
                       backend=backend, engine_args=engine_args or {}, resources=resources or {})


def render(spec: ReplicaSpec, replicas: int = 2, **settings) -> dict:
    return ManifestRenderer(KubernetesSettings(**settings)).deployment(spec, replicas)


def typed_round_trip(obj: dict, kind: str) -> dict:
    """Deserialize into the client's model and back; strict types fail, unknown keys vanish."""
    api = k8s.ApiClient()
    model = api._ApiClient__deserialize(obj, kind)
    return api.sanitize_for_serialization(model)


def values_anywhere(obj):
    if isinstance(obj, dict):
        for value in obj.values():
            yield value
            yield from values_anywhere(value)
    elif isinstance(obj, list):
        for value in obj:
            yield value
            yield from values_anywhere(value)


def only_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


# --- rendered manifests -----------------------------------------------------------------------

RENDER_CASES = {
    "builtin-cpu": make_spec("builtin", CPU_ONLY),
    "builtin-gpu": make_spec("builtin", H100, {"max_num_seqs": 32}),
    "vllm-gpu": make_spec("vllm", {**H100, "gpu_count": 2}, {"tensor_parallel_size": 2}),
    "vllm-no-resources": make_spec("vllm"),
}


@pytest.mark.parametrize("case", RENDER_CASES)
def test_rendered_deployment_is_a_valid_typed_object_with_nothing_unknown_or_none(case):
    deployment = render(RENDER_CASES[case])
    assert typed_round_trip(deployment, "V1Deployment") == deployment
    assert None not in list(values_anywhere(deployment))


@pytest.mark.parametrize("case", RENDER_CASES)
def test_rendered_deployment_wiring_holds_together(case):
    spec = RENDER_CASES[case]
    deployment = render(spec, replicas=4)
    service = ManifestRenderer(KubernetesSettings()).service(spec.deployment, spec.version)
    assert typed_round_trip(service, "V1Service") == service
    assert None not in list(values_anywhere(service))

    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert service["spec"]["selector"] == selector
    assert pod_labels["inferops.dev/deployment"] == spec.deployment
    assert pod_labels["inferops.dev/version"] == str(spec.version)
    assert pod_labels["app.kubernetes.io/name"] == "inferops"
    assert pod_labels["app.kubernetes.io/component"] == "replica"
    assert all(LABEL_VALUE.match(value) and len(value) <= 63 for value in pod_labels.values())
    assert deployment["spec"]["replicas"] == 4
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == "inferops"
    for name in (deployment["metadata"]["name"], service["metadata"]["name"]):
        assert name == "inferops-chat-v3" and DNS_1035_LABEL.match(name)

    container = only_container(deployment)
    port_names = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert port_names == {"http": 8000}
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == 8000 and port_names[service_port["targetPort"]] == 8000
    assert service["spec"]["type"] == "ClusterIP"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Model loading may take many minutes: only the startup probe has to wait that long.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert container["readinessProbe"]["periodSeconds"] == 5
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]

    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert mounts.keys() == volumes.keys()
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "inferops-models",
                                                          "readOnly": True}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert all(isinstance(arg, str) for arg in container["args"])
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama-3-8b/v3"
    assert args[args.index("--served-model-name") + 1] == "chat"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("case", ["builtin-gpu", "vllm-gpu"])
def test_gpu_pods_ask_for_whole_gpus_on_the_right_nodes(case):
    spec = RENDER_CASES[case]
    deployment = render(spec, gpu_products={"nvidia-h100": "NVIDIA-H100-80GB-HBM3"})
    resources = only_container(deployment)["resources"]
    assert resources["limits"] == resources["requests"]
    assert resources["limits"]["nvidia.com/gpu"] == str(spec.resources["gpu_count"])
    assert parse_quantity(resources["limits"]["cpu"]) == 4
    assert parse_quantity(resources["limits"]["memory"]) == 16 * 2**30
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu_toleration in pod["tolerations"]


def test_replica_pods_drop_privileges_and_builtin_ones_run_as_the_images_user():
    for backend in ("builtin", "vllm"):
        deployment = render(make_spec(backend))
        container = only_container(deployment)
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}
        pod_context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}
        # vLLM's image runs as root; asking it not to would stop the pod from starting.
        assert pod_context.get("runAsNonRoot") is (True if backend == "builtin" else None)
    builtin = render(make_spec("builtin"))["spec"]["template"]["spec"]["securityContext"]
    assert builtin["runAsUser"] == 10001


def test_cpu_only_and_unset_resources_ask_for_no_gpu():
    cpu_only = render(RENDER_CASES["builtin-cpu"])
    resources = only_container(cpu_only)["resources"]
    assert resources == {"requests": CPU_ONLY, "limits": CPU_ONLY}
    assert all(parse_quantity(value) > 0 for value in resources["limits"].values())
    for deployment in (cpu_only, render(RENDER_CASES["vllm-no-resources"]),
                       render(make_spec(resources={"gpu_type": "nvidia-h100", "gpu_count": 0}))):
        pod = deployment["spec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in json.dumps(pod)
        assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "resources" not in only_container(render(RENDER_CASES["vllm-no-resources"]))


@pytest.mark.parametrize("resources, field", [
    ({"cpu": "four"}, "resources.cpu"),
    ({"memory": "16 GB"}, "resources.memory"),
    ({"memory": "-1Gi"}, "resources.memory"),
    ({"gpu_count": "1"}, "resources.gpu_count"),
    ({"gpu_count": -1}, "resources.gpu_count"),
    ({"gpu_count": True}, "resources.gpu_count"),
])
def test_bad_resources_are_refused_naming_the_field(resources, field):
    with pytest.raises(DriverError, match=re.escape(field)):
        render(make_spec(resources=resources))


def test_builtin_container_runs_inferops_serve_and_its_parser_accepts_every_arg():
    engine_args = {"max_num_seqs": 16, "no_prefix_caching": True, "dtype": "float32",
                   "drain_timeout": 12.5, "block_size": 8}
    container = only_container(render(make_spec("builtin", engine_args=engine_args)))
    assert container["image"] == "inferops:latest"
    assert container["command"] == ["inferops", "serve"]
    args = container["args"]
    assert args[args.index("--max-num-seqs") + 1] == "16"
    assert args[args.index("--drain-timeout") + 1] == "12.5"
    assert args.count("--no-prefix-caching") == 1
    assert args[args.index("--no-prefix-caching") + 1].startswith("--")  # a bare flag

    import argparse

    parser = argparse.ArgumentParser(prog="inferops serve", exit_on_error=False)
    builtin_server_arguments(parser)
    parsed = parser.parse_args(args)
    assert (parsed.model, parsed.port, parsed.host) == ("/models/llama-3-8b/v3", 8000, "0.0.0.0")
    assert parsed.served_model_name == "chat"
    assert (parsed.max_num_seqs, parsed.no_prefix_caching, parsed.drain_timeout) == (16, True, 12.5)
    assert (parsed.dtype, parsed.block_size) == ("float32", 8)


def test_vllm_container_keeps_the_image_entrypoint_and_maps_engine_args():
    engine_args = {"max_model_len": 4096, "gpu_memory_utilization": 0.9, "enforce_eager": True,
                   "enable_prefix_caching": False, "kv_cache_dtype": "fp8"}
    deployment = render(make_spec("vllm", H100, engine_args), vllm_image="registry.local/vllm:0.32")
    container = only_container(deployment)
    assert container["image"] == "registry.local/vllm:0.32"
    assert "command" not in container
    assert container["args"] == [
        "--model", "/models/llama-3-8b/v3", "--served-model-name", "chat", "--host", "0.0.0.0",
        "--port", "8000", "--max-model-len", "4096", "--gpu-memory-utilization", "0.9",
        "--enforce-eager", "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8",
    ]
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["enableServiceLinks"] is False


def test_grace_period_covers_prestop_drain_and_exit():
    pod = render(make_spec(engine_args={"drain_timeout": 45.2}))["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 46 + 10
    pod = render(make_spec(), termination_grace_s=90)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 90


def test_unknown_backend_is_refused():
    with pytest.raises(DriverError, match="backend 'tgi'"):
        render(make_spec("tgi"))


def test_long_deployment_names_are_shortened_deterministically():
    long_a = "a" * 55 + "-serving"   # 63 characters, the longest a deployment name may be
    long_b = "a" * 55 + "-servinh"
    for version in (1, 12345):
        name = object_name(long_a, version)
        assert len(name) <= 63 and DNS_1035_LABEL.match(name)
        assert name.endswith(f"-v{version}") and name.startswith("inferops-aaaa")
        assert name == object_name(long_a, version)
        assert name != object_name(long_b, version)
    # A cut that would end on a hyphen must not leave one before the hash.
    hyphens = "b" * 40 + "-" * 10 + "c" * 13
    assert re.fullmatch(r"inferops-b{40}-[0-9a-f]{8}-v7", object_name(hyphens, 7))
    assert object_name("chat", 3) == "inferops-chat-v3"
    deployment = render(make_spec(deployment=long_a, version=12345))
    assert typed_round_trip(deployment, "V1Deployment") == deployment
    assert deployment["metadata"]["name"] == object_name(long_a, 12345)
    assert deployment["spec"]["selector"]["matchLabels"]["inferops.dev/deployment"] == long_a


def test_model_paths_map_under_the_mount_or_are_refused():
    config = KubernetesSettings(models_root="/srv/models", models_mount="/models")
    assert model_path_in_pod("/srv/models/llama/v3", config) == "/models/llama/v3"
    assert model_path_in_pod("file:///srv/models/llama/v3/", config) == "/models/llama/v3"
    assert model_path_in_pod("/srv/models", config) == "/models"
    for outside in ("/srv/models-old/llama", "/srv/models/../secrets", "/home/me/llama"):
        with pytest.raises(DriverError, match="INFEROPS_K8S_MODELS_ROOT"):
            model_path_in_pod(outside, config)


def test_host_path_volume_replaces_the_claim_when_configured():
    deployment = render(make_spec(), models_host_path="/mnt/models")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"] == {"name": "models",
                                 "hostPath": {"path": "/mnt/models", "type": "Directory"}}
    assert typed_round_trip(deployment, "V1Deployment") == deployment


def test_settings_come_from_django_settings(settings):
    settings.INFEROPS_K8S_NAMESPACE = "serving"
    settings.INFEROPS_K8S_IMAGE = "registry.local/inferops:1.2"
    config = KubernetesSettings.from_django()
    assert (config.namespace, config.image) == ("serving", "registry.local/inferops:1.2")
    assert config.models_pvc == "inferops-models"   # untouched settings keep their defaults
    deployment = ManifestRenderer(config).deployment(make_spec(), 1)
    assert deployment["metadata"]["namespace"] == "serving"


def test_settings_absent_from_django_come_from_the_environment(settings, monkeypatch):
    # The kustomize ConfigMap sets these as environment variables of the worker.
    monkeypatch.setenv("INFEROPS_K8S_IMAGE", "inferops-replica:0.1.0")
    monkeypatch.setenv("INFEROPS_K8S_STARTUP_TIMEOUT_S", "600")
    monkeypatch.setenv("INFEROPS_K8S_GPU_PRODUCTS", '{"nvidia-h100": "NVIDIA-H100-80GB-HBM3"}')
    monkeypatch.setenv("INFEROPS_K8S_NAMESPACE", "ignored")
    settings.INFEROPS_K8S_NAMESPACE = "serving"
    config = KubernetesSettings.from_django()
    assert (config.image, config.startup_timeout_s) == ("inferops-replica:0.1.0", 600)
    assert config.gpu_products == {"nvidia-h100": "NVIDIA-H100-80GB-HBM3"}
    assert config.namespace == "serving"  # a Django setting wins over the environment
    monkeypatch.setenv("INFEROPS_K8S_STARTUP_TIMEOUT_S", "soon")
    with pytest.raises(DriverError, match="INFEROPS_K8S_STARTUP_TIMEOUT_S='soon'"):
        KubernetesSettings.from_django()


# --- the fake API server ----------------------------------------------------------------------

@dataclass
class Recorded:
    method: str
    path: str
    query: dict
    content_type: str
    authorization: str
    body: object


def status_body(code: int, message: str, reason: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def matches(labels: dict, selector: str) -> bool:
    wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
    return wanted.items() <= labels.items()


class FakeKubernetesApi:
    """Stands in for a cluster's API server, which this machine cannot reach."""

    def __init__(self):
        self.requests: list[Recorded] = []
        self.objects: dict[str, dict] = {}
        self.pods: list[dict] = []
        self.logs: dict[str, str] = {}
        self.failures: dict[tuple[str, str], tuple[int, str, str]] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def fail(self, method: str, path: str, code: int, message: str, reason: str = "Invalid"):
        self.failures[(method, path)] = (code, message, reason)

    def api_client(self) -> k8s.ApiClient:
        return k8s.ApiClient(k8s.Configuration(host=self.url))

    def paths(self, method: str) -> list[str]:
        return [request.path for request in self.requests if request.method == method]

    def _pods_in(self, namespace: str, selector: str) -> list[dict]:
        return [pod for pod in self.pods if pod["metadata"]["namespace"] == namespace
                and matches(pod["metadata"]["labels"], selector)]

    def handle(self, method: str, path: str, query: dict, body):
        """-> (status, json body or text)."""
        if (method, path) in self.failures:
            code, message, reason = self.failures[(method, path)]
            return code, status_body(code, message, reason)
        pods_path = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)
        if pods_path:
            selected = self._pods_in(pods_path.group(1), query.get("labelSelector", ""))
            if method == "DELETE":
                self.pods = [pod for pod in self.pods if pod not in selected]
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": selected}
        if path.endswith("/log"):
            return 200, self.logs[path.split("/")[-2]]
        if path.endswith("/scale"):
            parent = self.objects.get(path.removesuffix("/scale"))
            if parent is None:
                return 404, status_body(404, "deployments.apps not found", "NotFound")
            parent["spec"]["replicas"] = body["spec"]["replicas"]
            return 200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                         "metadata": parent["metadata"], "spec": body["spec"]}
        if method == "PATCH":
            created = path not in self.objects
            self.objects[path] = body
            return (201 if created else 200), body
        if path not in self.objects:
            return 404, status_body(404, f"{path.split('/')[-1]} not found", "NotFound")
        if method == "DELETE":
            removed = self.objects.pop(path)
            if "/apis/apps/" in path:
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            return 200, removed
        return 200, self.objects[path]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                url = urlparse(self.path)
                query = {key: values[0] for key, values in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                fake.requests.append(Recorded(
                    self.command, url.path, query, self.headers.get("Content-Type", ""),
                    self.headers.get("Authorization", ""), body))
                status, payload = fake.handle(self.command, url.path, query, body)
                is_text = isinstance(payload, str)
                data = (payload if is_text else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if is_text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = _serve

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture
def fake_api():
    fake = FakeKubernetesApi()
    yield fake
    fake.close()


def pod(name: str, ready: bool, created: str, labels: dict, waiting: str = "",
        ip: str = "10.0.0.1") -> dict:
    state = {"waiting": {"reason": waiting, "message": "back-off 5m0s"}} if waiting else {
        "running": {"startedAt": created}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "inferops", "labels": labels,
                     "creationTimestamp": created},
        "spec": {"containers": [{"name": "replica", "image": "inferops:latest"}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "replica", "image": "inferops:latest", "imageID": "",
                                   "ready": ready, "restartCount": 0 if ready else 4,
                                   "state": state}],
        },
    }


def unsaved_replica(identity: dict | None = None) -> Replica:
    """A Replica object as the reconcile loop holds it; these driver calls never query its row."""
    model_version = ModelVersion(number=3)
    return Replica(deployment=Deployment(name="chat", version=model_version), version=model_version,
                   identity=identity or {})


DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/inferops/deployments/inferops-chat-v3"
SERVICE_PATH = "/api/v1/namespaces/inferops/services/inferops-chat-v3"


# --- the apply path ---------------------------------------------------------------------------

def test_apply_uses_server_side_apply_on_the_right_paths(fake_api):
    renderer = ManifestRenderer(KubernetesSettings())
    cluster = ClusterObjects(fake_api.api_client())
    deployment, service = renderer.deployment(make_spec(), 2), renderer.service("chat", 3)
    cluster.apply_service(service)
    cluster.apply_deployment(deployment)
    cluster.apply_deployment(deployment)   # again: the fake answers 200 instead of 201

    assert [(r.method, r.path) for r in fake_api.requests] == [
        ("PATCH", SERVICE_PATH), ("PATCH", DEPLOYMENT_PATH), ("PATCH", DEPLOYMENT_PATH)]
    for request in fake_api.requests:
        assert request.content_type == APPLY_CONTENT_TYPE
        assert request.query == {"fieldManager": "inferops", "force": "true"}
    assert fake_api.requests[0].body == service
    assert fake_api.requests[1].body == deployment


@pytest.mark.parametrize("code, reason, message", [
    (422, "Invalid", 'Deployment.apps "inferops-chat-v3" is invalid: spec.template.spec.'
                     'containers[0].resources.requests: Invalid value: "2": must be less than '
                     'or equal to nvidia.com/gpu limit of 1'),
    (409, "Conflict", 'Apply failed with 1 conflict: conflict with "kubectl" using apps/v1: '
                      '.spec.replicas'),
    (403, "Forbidden", 'deployments.apps "inferops-chat-v3" is forbidden: User '
                       '"system:serviceaccount:inferops:worker" cannot patch resource'),
])
def test_api_errors_become_driver_errors_with_status_and_message(fake_api, code, reason, message):
    fake_api.fail("PATCH", DEPLOYMENT_PATH, code, message, reason)
    cluster = ClusterObjects(fake_api.api_client())
    with pytest.raises(DriverError) as raised:
        cluster.apply_deployment(ManifestRenderer(KubernetesSettings()).deployment(make_spec(), 1))
    text = str(raised.value)
    assert "apply Deployment inferops/inferops-chat-v3" in text
    assert f"HTTP {code}" in text and message in text


def test_unreachable_api_server_is_a_driver_error():
    config = k8s.Configuration(host=f"http://127.0.0.1:{free_port()}")
    config.retries = 0
    cluster = ClusterObjects(k8s.ApiClient(config))
    with pytest.raises(DriverError, match="could not reach the Kubernetes API to apply Service"):
        cluster.apply_service(ManifestRenderer(KubernetesSettings()).service("chat", 3))


def kubeconfig_for(server: str, token: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "ops",
        "clusters": [{"name": "gpu-cluster", "cluster": {"server": server}}],
        "users": [{"name": "ops", "user": {"token": token}}],
        "contexts": [{"name": "ops", "context": {"cluster": "gpu-cluster", "user": "ops"}}],
    }


def test_outside_a_pod_credentials_come_from_the_kubeconfig(fake_api, tmp_path, monkeypatch):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig_for(fake_api.url, "t0ken")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)   # not in a pod
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    driver = KubernetesDriver(config=KubernetesSettings())
    assert driver.is_alive(unsaved_replica()) is False
    assert [(r.path, r.authorization) for r in fake_api.requests] == [
        (DEPLOYMENT_PATH, "Bearer t0ken")]

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))
    with pytest.raises(DriverError, match="no Kubernetes credentials"):
        KubernetesDriver(config=KubernetesSettings()).is_alive(unsaved_replica())


def test_is_alive_reads_the_deployment(fake_api):
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=KubernetesSettings())
    replica = unsaved_replica()
    assert driver.is_alive(replica) is False          # 404: never applied, or deleted
    assert driver.adopt(replica) is None
    fake_api.objects[DEPLOYMENT_PATH] = render(make_spec(), replicas=1)
    assert driver.is_alive(replica) is True
    # A worker died between start and saving the identity: the next pass re-attaches the row.
    replica.identity = {"health_failures": 1}
    assert driver.adopt(replica) == "inferops-chat-v3"
    assert replica.identity == {"namespace": "inferops", "deployment": "inferops-chat-v3",
                                "service": "inferops-chat-v3", "version": 3, "health_failures": 1}
    assert replica.url == "http://inferops-chat-v3.inferops.svc.cluster.local:8000"
    assert replica.port == 8000
    requests_before = len(fake_api.requests)
    assert driver.adopt(replica) is None              # nothing lost: no API call
    assert len(fake_api.requests) == requests_before
    assert driver.node == "inferops"
    fake_api.objects[DEPLOYMENT_PATH]["spec"]["replicas"] = 0
    assert driver.is_alive(replica) is False
    fake_api.fail("GET", DEPLOYMENT_PATH, 500, "etcdserver: request timed out", "InternalError")
    with pytest.raises(DriverError, match="HTTP 500.*etcdserver: request timed out"):
        driver.is_alive(replica)
    assert fake_api.paths("GET") == [DEPLOYMENT_PATH] * 6


def test_identity_namespace_wins_over_a_changed_setting(fake_api):
    driver = KubernetesDriver(api_client=fake_api.api_client(),
                              config=KubernetesSettings(namespace="moved"))
    replica = unsaved_replica({"namespace": "inferops", "deployment": "inferops-chat-v3",
                               "service": "inferops-chat-v3", "version": 3})
    driver.is_alive(replica)
    assert fake_api.paths("GET") == [DEPLOYMENT_PATH]


def test_log_tail_reads_the_not_ready_pod_first_and_is_empty_on_errors(fake_api):
    labels = render(make_spec())["spec"]["template"]["metadata"]["labels"]
    other_version = {**labels, "inferops.dev/version": "2"}
    fake_api.pods = [
        pod("inferops-chat-v3-aaa", True, "2026-11-30T10:00:00Z", labels, ip="10.0.0.7"),
        pod("inferops-chat-v3-bbb", False, "2026-11-30T09:00:00Z", labels, "CrashLoopBackOff"),
        pod("inferops-chat-v2-ccc", True, "2026-11-30T11:00:00Z", other_version, ip="10.0.0.9"),
        pod("inferops-chat-v3-ddd", True, "2026-11-30T08:00:00Z", labels, ip="10.0.0.3"),
    ]
    fake_api.logs = {"inferops-chat-v3-bbb": "loading weights\nCUDA out of memory\n"}
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=KubernetesSettings())
    replica = unsaved_replica()
    assert driver.log_tail(replica, lines=20) == "loading weights\nCUDA out of memory\n"
    log_request = fake_api.requests[-1]
    assert log_request.path == "/api/v1/namespaces/inferops/pods/inferops-chat-v3-bbb/log"
    assert log_request.query == {"container": "replica", "tailLines": "20"}
    list_request = fake_api.requests[-2]
    assert matches(labels, list_request.query["labelSelector"])
    assert not matches(other_version, list_request.query["labelSelector"])

    assert driver.ready_pod_urls(replica) == ["http://10.0.0.3:8000", "http://10.0.0.7:8000"]
    fake_api.objects[DEPLOYMENT_PATH] = render(make_spec(), replicas=2)
    assert driver.exit_status(replica) == (
        "pod inferops-chat-v3-bbb: CrashLoopBackOff: back-off 5m0s")

    fake_api.fail("GET", log_request.path, 400, 'container "replica" is waiting to start')
    assert driver.log_tail(replica) == ""
    fake_api.pods = []
    assert driver.log_tail(replica) == ""
    del fake_api.objects[DEPLOYMENT_PATH]
    assert driver.exit_status(replica) == "Deployment inferops/inferops-chat-v3 no longer exists"


# --- start / stop / kill with real Replica rows -----------------------------------------------

@pytest.fixture
def chat_rows(db, tiny_llama_dir):
    model = services.model_create(name="tiny-chat", task="generate", actor=None)
    version = services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    deployment = Deployment.objects.create(name="chat", model=model, version=version,
                                           backend="builtin", driver="kubernetes")
    return deployment, version


def new_replica(deployment, version, state=ReplicaState.PENDING) -> Replica:
    return Replica.objects.create(deployment=deployment, version=version, driver="kubernetes",
                                  node="inferops", state=state)


def test_replica_count_follows_live_rows_through_start_stop_and_kill(fake_api, chat_rows,
                                                                     tiny_llama_dir):
    deployment, version = chat_rows
    config = KubernetesSettings(models_root=str(tiny_llama_dir.parent))
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=config)
    spec = ReplicaSpec(deployment="chat", version=version.number, model_path=str(tiny_llama_dir),
                       backend="builtin", engine_args={"max_num_seqs": 4})
    name = f"inferops-chat-v{version.number}"
    deployment_path = f"/apis/apps/v1/namespaces/inferops/deployments/{name}"
    service_path = f"/api/v1/namespaces/inferops/services/{name}"
    first, second = new_replica(deployment, version), new_replica(deployment, version)
    new_replica(deployment, version, ReplicaState.FAILED)   # a dead row wants no pod

    started = driver.start(first, spec)
    assert started.url == f"http://{name}.inferops.svc.cluster.local:8000"
    assert started.port == 8000
    assert started.identity == {"namespace": "inferops", "deployment": name, "service": name,
                                "version": version.number}
    applied = fake_api.objects[deployment_path]
    assert applied["spec"]["replicas"] == 2   # both live rows, the pending one included
    secret_name = only_container(applied)["env"][0]["valueFrom"]["secretKeyRef"]["name"]
    secret = fake_api.objects[f"/api/v1/namespaces/inferops/secrets/{secret_name}"]
    assert secret["stringData"]["token"] == replica_admin_token()   # the Secret the pods read
    assert secret["metadata"]["labels"][INSTALLATION_LABEL] == driver.installation
    args = only_container(applied)["args"]
    assert args[args.index("--model") + 1] == f"/models/{tiny_llama_dir.name}"
    assert fake_api.objects[service_path]["spec"]["selector"] == applied["spec"]["selector"][
        "matchLabels"]
    for row in (first, second):
        row.identity, row.state = started.identity, ReplicaState.STARTING
        row.save()
    driver.start(second, spec)                # a retried start converges to the same count
    assert fake_api.objects[deployment_path]["spec"]["replicas"] == 2

    first.state = ReplicaState.DRAINING
    first.save()
    driver.stop(first, grace_s=30)
    driver.kill(first)                        # stop then kill of one row lowers the count once
    scale_requests = [r for r in fake_api.requests if r.path.endswith("/scale")]
    assert [r.body for r in scale_requests] == [{"spec": {"replicas": 1}}] * 2
    assert all(r.method == "PATCH" and r.content_type == "application/merge-patch+json"
               for r in scale_requests)
    assert fake_api.objects[deployment_path]["spec"]["replicas"] == 1
    assert driver.is_alive(second)

    second.state = ReplicaState.DRAINING
    second.save()
    driver.stop(second)
    assert deployment_path not in fake_api.objects and service_path not in fake_api.objects
    assert not [r for r in fake_api.requests if r.method == "DELETE" and r.path.endswith("/pods")]
    assert driver.is_alive(second) is False

    driver.kill(second)                       # gone already: 404s are fine, the pods go now
    pod_delete = fake_api.requests[-1]
    assert (pod_delete.method, pod_delete.path) == ("DELETE", "/api/v1/namespaces/inferops/pods")
    assert pod_delete.query["gracePeriodSeconds"] == "0"
    assert matches(applied["spec"]["selector"]["matchLabels"], pod_delete.query["labelSelector"])


def test_start_reports_api_refusals(fake_api, chat_rows, tiny_llama_dir):
    deployment, version = chat_rows
    config = KubernetesSettings(models_root=str(tiny_llama_dir.parent))
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=config)
    spec = ReplicaSpec(deployment="chat", version=version.number, model_path=str(tiny_llama_dir),
                       backend="builtin")
    fake_api.fail("PATCH", f"/api/v1/namespaces/inferops/services/inferops-chat-v{version.number}",
                  403, 'services is forbidden: User "system:anonymous" cannot patch', "Forbidden")
    with pytest.raises(DriverError, match="HTTP 403.*cannot patch"):
        driver.start(new_replica(deployment, version), spec)


def test_another_installations_objects_in_the_namespace_are_never_touched(fake_api, chat_rows, tiny_llama_dir):
    """Two installations pointed at one namespace both name their objects inferops-chat-v<N>."""
    deployment, version = chat_rows
    driver = KubernetesDriver(api_client=fake_api.api_client(),
                              config=KubernetesSettings(models_root=str(tiny_llama_dir.parent)))
    spec = ReplicaSpec(deployment="chat", version=version.number, model_path=str(tiny_llama_dir),
                       backend="builtin")
    ours = new_replica(deployment, version)
    started = driver.start(ours, spec)  # ours first: labelled with this installation's id
    deployment_path = f"/apis/apps/v1/namespaces/inferops/deployments/{started.identity['deployment']}"
    assert fake_api.objects[deployment_path]["metadata"]["labels"]["inferops.dev/installation"] == \
        driver.installation
    ours.identity, ours.state = started.identity, ReplicaState.STARTING
    ours.save()
    assert driver.is_alive(ours)

    fake_api.objects[deployment_path]["metadata"]["labels"]["inferops.dev/installation"] = "their-installation"
    before = len(fake_api.requests)
    with pytest.raises(DriverError, match="belongs to another inferops installation .*own namespace"):
        driver.start(new_replica(deployment, version), spec)
    assert driver.is_alive(ours) is False
    driver.stop(ours)
    driver.kill(ours)
    assert {r.method for r in fake_api.requests[before:]} == {"GET"}  # read, never written
    assert deployment_path in fake_api.objects


def test_the_reconcile_loop_drives_the_replica_count(fake_api, tiny_llama_dir, db):
    """The real reconcile loop with this driver: start two, scale to one, delete the deployment."""
    model = services.model_create(name="tiny-k8s", task="generate", actor=None)
    version = services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    deployment = Deployment.objects.create(name="k8s-chat", model=model, version=version,
                                           backend="builtin", driver="kubernetes", replicas=2)
    config = KubernetesSettings(models_root=str(tiny_llama_dir.parent))
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=config)
    path = f"/apis/apps/v1/namespaces/inferops/deployments/inferops-k8s-chat-v{version.number}"
    now = timezone.now()

    def reconcile_pass(seconds_later: int) -> None:
        deployment.refresh_from_db()
        Reconciler(deployment, now=now + timedelta(seconds=seconds_later), driver=driver).run()

    reconcile_pass(0)
    assert fake_api.objects[path]["spec"]["replicas"] == 2
    rows = list(Replica.objects.filter(deployment=deployment))
    assert [row.state for row in rows] == [ReplicaState.STARTING] * 2
    assert {row.url for row in rows} == {
        f"http://inferops-k8s-chat-v{version.number}.inferops.svc.cluster.local:8000"}
    assert {row.node for row in rows} == {"inferops"}

    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconcile_pass(5)   # still starting (its /health is out of reach here): one is stopped
    assert fake_api.objects[path]["spec"]["replicas"] == 1
    assert Replica.objects.filter(deployment=deployment, state__in=ReplicaState.live()).count() == 1

    Deployment.objects.filter(pk=deployment.pk).update(deleted_at=now)
    reconcile_pass(10)
    assert path not in fake_api.objects
    assert not Replica.objects.filter(deployment=deployment, state__in=ReplicaState.live()).exists()


# --- the worker's Role grants what the driver calls, and nothing else ---------------------------

RBAC_MANIFEST = Path(__file__).resolve().parents[2] / "platform/kubernetes/base/rbac.yaml"


def rbac_permission(request: Recorded) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) that RBAC checks for one request, as the API server derives it."""
    parts = request.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces", request.path  # the driver stays in its namespace
    resource, name, subresource = rest[2], rest[3] if len(rest) > 3 else "", rest[4:]
    if subresource:
        resource = f"{resource}/{subresource[0]}"
    verb = {("GET", True): "get", ("GET", False): "list", ("PATCH", True): "patch",
            ("DELETE", True): "delete", ("DELETE", False): "deletecollection"}[
        (request.method, bool(name))]
    permissions = {(group, resource, verb)}
    if request.content_type.startswith(APPLY_CONTENT_TYPE):
        # Server-side apply of an object that does not exist yet is authorized as a create.
        permissions.add((group, resource, "create"))
    return permissions


def test_the_worker_role_grants_exactly_the_driver_calls(fake_api, chat_rows, tiny_llama_dir):
    deployment, version = chat_rows
    config = KubernetesSettings(models_root=str(tiny_llama_dir.parent))
    driver = KubernetesDriver(api_client=fake_api.api_client(), config=config)
    spec = ReplicaSpec(deployment="chat", version=version.number, model_path=str(tiny_llama_dir),
                       backend="builtin", engine_args={})
    first, second = new_replica(deployment, version), new_replica(deployment, version)
    # Every driver operation: start, status, pods, logs, scale down, delete, kill.
    for row in (first, second):
        started = driver.start(row, spec)
        row.identity, row.state = started.identity, ReplicaState.READY
        row.save()
    labels = fake_api.objects[f"/apis/apps/v1/namespaces/inferops/deployments/{started.identity['deployment']}"][
        "spec"]["template"]["metadata"]["labels"]
    fake_api.pods = [pod("inferops-chat-aaa", False, "2026-11-30T10:00:00Z", labels, "CrashLoopBackOff")]
    fake_api.logs = {"inferops-chat-aaa": "boom\n"}
    assert driver.is_alive(first) and driver.log_tail(first) == "boom\n"
    driver.exit_status(first)
    driver.ready_pod_urls(first)
    for row in (first, second):
        row.state = ReplicaState.DRAINING
        row.save()
        driver.stop(row)
    driver.kill(second)

    used = set().union(*(rbac_permission(request) for request in fake_api.requests))
    role = next(d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d["kind"] == "Role")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert used == granted
