"""Kubernetes driver: replicas as pods of one Deployment (and one Service) per deployment version.

Each (inferops deployment, registry version) pair owns a Kubernetes Deployment and a ClusterIP
Service, both named `inferops-<deployment>-v<version>`. A Replica row is a slot in that
Deployment, not one named pod: the pods of a version are interchangeable and the Service spreads
requests across the ready ones, so the reconcile loop keeps its per-row bookkeeping while
Kubernetes keeps the pods.

`spec.replicas` is always derived from the database, never incremented: it is the number of live
Replica rows of that deployment version on this driver (counting the row being started, leaving
out the row being stopped). Recomputing instead of adding or subtracting one makes every call
idempotent, so a stop followed by a kill of the same row, a retried start, or two workers starting
rows of the same version at once all converge to the same count.

Every object carries this installation's id (label `inferops.dev/installation`): two installations
pointed at one namespace would otherwise share `inferops-chat-v1`. The driver never applies,
scales or deletes an object another installation labelled, and says to give each installation
its own namespace.

Built-in replicas read their admin API token (inferops/replica_admin.py) from a Secret of the
installation, applied with their first start and left in place: the Deployment names the Secret and
carries a keyed digest of the token, so reading it reveals nothing and a new token rolls the pods.

Objects are written with server-side apply (field manager "inferops", forced): a re-apply with
an unchanged pod template changes only `spec.replicas` and never triggers a rollout.

Because rows are slots, every row of a version shares the Service URL: a /health or /metrics
request through it reaches one ready pod at random, and a stop or kill lets Kubernetes choose
which pod goes. `ready_pod_urls` lists the pods themselves: the scraper reads each one.

Settings (all optional, read from django.conf.settings, else from the environment variable of the
same name; platform/kubernetes/base/config.yaml sets them):
    INFEROPS_K8S_NAMESPACE          namespace of every object (default "inferops")
    INFEROPS_K8S_IMAGE              image with the `inferops` CLI (default "inferops:latest")
    INFEROPS_K8S_VLLM_IMAGE         vLLM OpenAI server image (default "vllm/vllm-openai:latest")
    INFEROPS_K8S_MODELS_PVC         claim holding the checkpoints (default "inferops-models")
    INFEROPS_K8S_MODELS_HOST_PATH   use this node directory instead of the PVC when set
    INFEROPS_K8S_MODELS_MOUNT       where the volume is mounted in the pod (default "/models")
    INFEROPS_K8S_MODELS_ROOT        where the control plane sees that same volume (default
                                    "/models"); a checkpoint at ROOT/a/b runs from MOUNT/a/b
    INFEROPS_K8S_GPU_NODE_LABEL     node label matched against the GPU type (default
                                    "nvidia.com/gpu.product", set by NVIDIA GPU feature discovery)
    INFEROPS_K8S_GPU_PRODUCTS       {gpu_type: node label value}; a gpu_type not in it is used as is
    INFEROPS_K8S_TERMINATION_GRACE_S  grace when engine_args has no drain_timeout (default 60)
    INFEROPS_K8S_STARTUP_TIMEOUT_S  how long model loading may take before the pod restarts (1800)
    INFEROPS_K8S_CLUSTER_DOMAIN     cluster DNS suffix of the Service URL (default "cluster.local")
    INFEROPS_K8S_DCGM_NAMESPACE     namespace of the dcgm-exporter pods the scraper reads GPU series
                                    from (default "gpu-operator", where the NVIDIA GPU Operator runs it)
    INFEROPS_K8S_DCGM_SELECTOR      label selector of those pods (default
                                    "app.kubernetes.io/name=dcgm-exporter", the Helm chart's label;
                                    the GPU Operator's pods carry "app=nvidia-dcgm-exporter")
    INFEROPS_K8S_DCGM_PORT          their metrics port (default 9400); the path is /metrics
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlparse

import urllib3
from django.conf import settings
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from deployments.choices import ReplicaState
from deployments.engine_args import to_argv
from deployments.models import Replica
from deployments.replicas.drivers.base import DriverError, ReplicaSpec, Started
from deployments.replicas.gpu_metrics import GpuSource
from inferops.models import installation_id
from inferops.replica_admin import ADMIN_TOKEN_ENV, replica_admin_token, replica_admin_token_digest

log = logging.getLogger(__name__)

PORT = 8000
PORT_NAME = "http"
CONTAINER_NAME = "replica"
FIELD_MANAGER = "inferops"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"
# Kubernetes removes a terminating pod from the Service's endpoints asynchronously; until every
# kube-proxy has caught up, new requests still arrive. Sleeping before SIGTERM lets them land on
# a server that is still accepting, instead of on one that has begun to drain.
PRESTOP_SLEEP_S = 5
# Time for the process to exit after its drain has finished (flush logs, free the GPU).
EXIT_MARGIN_S = 10
REQUEST_TIMEOUT_S = 15
MAX_NAME_LENGTH = 63  # a Service name is a DNS-1035 label
GPU_RESOURCE = "nvidia.com/gpu"
# On the Deployment and Service only: the selector and pod template stay as they were, so adding
# it to existing objects rolls no pod.
INSTALLATION_LABEL = "inferops.dev/installation"
IMAGE_UID = 10001  # the `inferops` user of platform/Dockerfile
ADMIN_SECRET_KEY = "token"
# A keyed digest of the admin token on the pod template: a new token (SECRET_KEY rotated) rolls the pods,
# which read it from the Secret only when they start.
ADMIN_TOKEN_DIGEST_ANNOTATION = "inferops.dev/admin-token-digest"


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str = "inferops"
    image: str = "inferops:latest"
    vllm_image: str = "vllm/vllm-openai:latest"
    models_pvc: str = "inferops-models"
    models_host_path: str = ""
    models_mount: str = "/models"
    models_root: str = "/models"
    gpu_node_label: str = "nvidia.com/gpu.product"
    gpu_products: dict = field(default_factory=dict)
    termination_grace_s: int = 60
    startup_timeout_s: int = 1800
    cluster_domain: str = "cluster.local"
    dcgm_namespace: str = "gpu-operator"
    dcgm_selector: str = "app.kubernetes.io/name=dcgm-exporter"
    dcgm_port: int = 9400

    @classmethod
    def from_django(cls) -> KubernetesSettings:
        """Django settings first, then the INFEROPS_K8S_* environment variable (what the
        kustomize ConfigMap sets), then the default."""
        defaults = cls()
        values = {}
        for name in cls.__dataclass_fields__:
            key, default = f"INFEROPS_K8S_{name.upper()}", getattr(defaults, name)
            if hasattr(settings, key):
                values[name] = getattr(settings, key)
            elif os.environ.get(key, "") != "":
                values[name] = _from_env(os.environ[key], default, key)
            else:
                values[name] = default
        return cls(**values)


def _from_env(text: str, default, key: str):
    try:
        if isinstance(default, dict):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
        return type(default)(text)
    except ValueError as exc:
        raise DriverError(f"{key}={text!r}: {exc}") from None


def object_name(deployment: str, version: int) -> str:
    """`inferops-<deployment>-v<version>`, shortened with a stable hash to fit a DNS label."""
    suffix = f"-v{version}"
    name = f"inferops-{deployment}{suffix}"
    if len(name) <= MAX_NAME_LENGTH:
        return name
    # The hash covers the whole deployment name, so two long names sharing a prefix stay apart,
    # and the version stays readable at the end for whoever runs kubectl.
    digest = hashlib.sha256(deployment.encode()).hexdigest()[:8]
    room = MAX_NAME_LENGTH - len("inferops-") - len(f"-{digest}{suffix}")
    return f"inferops-{deployment[:room].rstrip('-')}-{digest}{suffix}"


def admin_secret_name(installation: str) -> str:
    """The Secret holding the built-in replicas' admin token; one per installation and namespace."""
    return "inferops-replica-admin" + (f"-{installation}" if installation else "")


def version_labels(deployment: str, version: int) -> dict[str, str]:
    """The labels selecting one deployment version's pods (the Deployment's immutable selector)."""
    return {
        "app.kubernetes.io/name": "inferops",
        "app.kubernetes.io/component": "replica",
        "inferops.dev/deployment": deployment,
        "inferops.dev/version": str(version),
    }


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def service_url(name: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{PORT}"


def model_path_in_pod(model_path: str, config: KubernetesSettings) -> str:
    """Map a checkpoint directory as the control plane sees it to where the pod sees it."""
    parsed = urlparse(model_path)
    local = parsed.path if parsed.scheme == "file" else model_path
    local = posixpath.normpath(local)
    root = posixpath.normpath(config.models_root)
    if local != root and not local.startswith(root.rstrip("/") + "/"):
        raise DriverError(
            f"model_path {model_path!r} is not under INFEROPS_K8S_MODELS_ROOT={root!r}: the "
            f"pods only see the models volume, mounted at {config.models_mount}. Register the "
            "checkpoint on that volume, or set INFEROPS_K8S_MODELS_ROOT to where the control "
            "plane mounts it."
        )
    return posixpath.normpath(posixpath.join(config.models_mount, posixpath.relpath(local, root)))


def termination_grace_seconds(engine_args: dict, config: KubernetesSettings) -> int:
    """Long enough for the preStop sleep, the server's own drain, and the process exit."""
    drain = engine_args.get("drain_timeout")
    if drain is None:
        return int(config.termination_grace_s)
    return PRESTOP_SLEEP_S + math.ceil(float(drain)) + EXIT_MARGIN_S


def _quantity(resources: dict, key: str) -> str | None:
    value = resources.get(key)
    if value is None or value == "":
        return None
    text = str(value)
    try:
        if parse_quantity(text) <= 0:
            raise ValueError("must be positive")
    except ValueError as exc:
        raise DriverError(
            f"resources.{key}: {text!r} is not a Kubernetes quantity ({exc})") from None
    return text


def _gpu_count(resources: dict) -> int:
    count = resources.get("gpu_count", 0) or 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise DriverError(f"resources.gpu_count: {count!r} must be a non-negative integer")
    return count


@dataclass(frozen=True)
class PodResources:
    """What one pod asks the scheduler for, from a deployment's `resources`."""

    requirements: dict    # V1ResourceRequirements as a dict; {} when nothing is asked
    node_selector: dict
    tolerations: list

    @classmethod
    def from_resources(cls, resources: dict, config: KubernetesSettings) -> PodResources:
        amounts = {
            name: quantity for name, quantity in
            (("cpu", _quantity(resources, "cpu")), ("memory", _quantity(resources, "memory")))
            if quantity is not None
        }
        gpus = _gpu_count(resources)
        node_selector: dict[str, str] = {}
        tolerations: list[dict] = []
        if gpus:
            amounts[GPU_RESOURCE] = str(gpus)
            gpu_type = resources.get("gpu_type")
            if gpu_type:
                product = config.gpu_products.get(gpu_type, gpu_type)
                node_selector[config.gpu_node_label] = str(product)
            # GPU node pools are commonly tainted so that CPU-only pods stay off them.
            tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
        # Requests equal limits: an inference pod in the Guaranteed QoS class is the last one the
        # kubelet evicts under memory pressure, and extended resources (GPUs) require it anyway.
        requirements = {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}
        return cls(requirements=requirements, node_selector=node_selector, tolerations=tolerations)


def _health_probe(period_s: int, failure_threshold: int, initial_delay_s: int = 0) -> dict:
    probe = {
        "httpGet": {"path": "/health", "port": PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }
    if initial_delay_s:
        probe["initialDelaySeconds"] = initial_delay_s
    return probe


class ManifestRenderer:
    """Turns a ReplicaSpec into the Deployment and Service dicts applied to the cluster."""

    def __init__(self, config: KubernetesSettings):
        self.config = config

    def container_command(self, spec: ReplicaSpec) -> tuple[str, list[str] | None, list[str]]:
        """(image, command or None to keep the image's entrypoint, args)."""
        model = model_path_in_pod(spec.model_path, self.config)
        served = ["--model", model, "--served-model-name", spec.deployment,
                  "--host", "0.0.0.0", "--port", str(PORT)]
        extra = to_argv(spec.run_args, spec.backend)
        if spec.backend == "vllm":
            # The vLLM image's entrypoint is its OpenAI server; only the options are ours.
            return self.config.vllm_image, None, served + extra
        if spec.backend != "builtin":
            raise DriverError(
                f"backend {spec.backend!r} cannot run on Kubernetes; use builtin or vllm")
        return self.config.image, ["inferops", "serve"], served + extra

    def deployment(self, spec: ReplicaSpec, replicas: int, installation: str = "") -> dict:
        name = object_name(spec.deployment, spec.version)
        labels = version_labels(spec.deployment, spec.version)
        image, command, args = self.container_command(spec)
        resources = PodResources.from_resources(spec.resources, self.config)
        startup_checks = max(1, math.ceil(self.config.startup_timeout_s / 5))
        container = {
            "name": CONTAINER_NAME,
            "image": image,
            "args": args,
            "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
            # Model loading is covered by the startup probe alone; once it passes, readiness
            # reacts within seconds (a draining server answers 503) and liveness restarts a
            # hung server.
            "startupProbe": _health_probe(period_s=5, failure_threshold=startup_checks),
            "readinessProbe": _health_probe(period_s=5, failure_threshold=3, initial_delay_s=5),
            "livenessProbe": _health_probe(period_s=10, failure_threshold=6),
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [
                {"name": "models", "mountPath": self.config.models_mount, "readOnly": True},
            ],
        }
        if command:
            container["command"] = command
        template_meta = {"labels": labels}
        if spec.backend == "builtin":
            # Its admin API, for the SLO targets the control plane sets. The token comes from a
            # Secret (admin_secret), so reading the Deployment does not reveal it.
            container["env"] = [{"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": admin_secret_name(installation), "key": ADMIN_SECRET_KEY}}}]
            template_meta["annotations"] = {ADMIN_TOKEN_DIGEST_ANNOTATION: replica_admin_token_digest()}
        if resources.requirements:
            container["resources"] = resources.requirements
        volumes = [self._models_volume()]
        if spec.backend == "vllm":
            # vLLM's workers share tensors through /dev/shm, which is 64 MiB in a container.
            container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        pod_spec = {
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds":
                termination_grace_seconds(spec.engine_args, self.config),
            # Service links would put *_PORT variables of every Service in the namespace into the
            # environment; vLLM reads VLLM_PORT and friends and breaks on them.
            "enableServiceLinks": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        }
        if spec.backend == "builtin":
            # The inferops image has a non-root user; vLLM's image runs as root, so only the
            # built-in engine's pods can promise it.
            pod_spec["securityContext"].update(
                {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID})
        if resources.node_selector:
            pod_spec["nodeSelector"] = resources.node_selector
        if resources.tolerations:
            pod_spec["tolerations"] = resources.tolerations
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": name,
                "namespace": self.config.namespace,
                "labels": {**labels, "app.kubernetes.io/managed-by": FIELD_MANAGER},
            },
            "spec": {
                "replicas": replicas,
                "revisionHistoryLimit": 2,
                "selector": {"matchLabels": labels},
                "template": {"metadata": template_meta, "spec": pod_spec},
            },
        }

    def admin_secret(self, installation: str) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": admin_secret_name(installation),
                "namespace": self.config.namespace,
                "labels": {"app.kubernetes.io/name": "inferops",
                           "app.kubernetes.io/managed-by": FIELD_MANAGER,
                           INSTALLATION_LABEL: installation},
            },
            "type": "Opaque",
            "stringData": {ADMIN_SECRET_KEY: replica_admin_token()},
        }

    def service(self, deployment: str, version: int) -> dict:
        labels = version_labels(deployment, version)
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": object_name(deployment, version),
                "namespace": self.config.namespace,
                "labels": {**labels, "app.kubernetes.io/managed-by": FIELD_MANAGER},
            },
            "spec": {
                "type": "ClusterIP",
                "selector": labels,
                "ports": [
                    {"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"},
                ],
            },
        }

    def _models_volume(self) -> dict:
        if self.config.models_host_path:
            return {"name": "models",
                    "hostPath": {"path": self.config.models_host_path, "type": "Directory"}}
        return {"name": "models",
                "persistentVolumeClaim": {"claimName": self.config.models_pvc, "readOnly": True}}


def _api_message(exc: ApiException) -> str:
    """The API server's own explanation (a Status object's message) or the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return f"HTTP {exc.status} {exc.reason or ''}".rstrip() + (f": {message}" if message else "")


@contextmanager
def api_errors(action: str) -> Iterator[None]:
    try:
        yield
    except ApiException as exc:
        raise DriverError(f"Kubernetes API refused to {action}: {_api_message(exc)}") from exc
    except urllib3.exceptions.HTTPError as exc:
        raise DriverError(f"could not reach the Kubernetes API to {action}: {exc}") from exc


def load_api_client() -> k8s.ApiClient:
    """In-cluster service account first (the workers run as pods), then ~/.kube/config."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config(client_configuration=configuration)
        except (k8s_config.ConfigException, OSError) as exc:
            raise DriverError(
                "no Kubernetes credentials: not running in a pod with a service account, and no "
                f"usable kubeconfig ({exc})"
            ) from exc
    return k8s.ApiClient(configuration)


class ClusterObjects:
    """The few API calls the driver makes, with errors turned into DriverError."""

    def __init__(self, api_client: k8s.ApiClient):
        self.apps = k8s.AppsV1Api(api_client)
        self.core = k8s.CoreV1Api(api_client)

    def apply_service(self, body: dict) -> None:
        self._apply(self.core.patch_namespaced_service, body)

    def apply_secret(self, body: dict) -> None:
        self._apply(self.core.patch_namespaced_secret, body)

    def apply_deployment(self, body: dict) -> None:
        self._apply(self.apps.patch_namespaced_deployment, body)

    @staticmethod
    def _apply(patch, body: dict) -> None:
        """Server-side apply, forced; an error names the object, never its data (a Secret's)."""
        meta = body["metadata"]
        with api_errors(f"apply {body['kind']} {meta['namespace']}/{meta['name']}"):
            patch(meta["name"], meta["namespace"], body, field_manager=FIELD_MANAGER, force=True,
                  _content_type=APPLY_CONTENT_TYPE, _request_timeout=REQUEST_TIMEOUT_S)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> bool:
        """Set spec.replicas through the scale subresource, as `kubectl scale` does; False if gone.

        stop and kill only have the Replica row, not the ReplicaSpec the pod template is rendered
        from, so they change the count alone. The next start re-applies the whole object and, with
        force, takes spec.replicas back under the apply.
        """
        try:
            with api_errors(f"scale Deployment {namespace}/{name} to {replicas}"):
                self.apps.patch_namespaced_deployment_scale(
                    name, namespace, {"spec": {"replicas": replicas}}, field_manager=FIELD_MANAGER,
                    _content_type=MERGE_PATCH_CONTENT_TYPE, _request_timeout=REQUEST_TIMEOUT_S,
                )
        except DriverError as exc:
            if _is_not_found(exc):
                return False
            raise
        return True

    def read_deployment(self, namespace: str, name: str) -> k8s.V1Deployment | None:
        try:
            with api_errors(f"read Deployment {namespace}/{name}"):
                return self.apps.read_namespaced_deployment(
                    name, namespace, _request_timeout=REQUEST_TIMEOUT_S)
        except DriverError as exc:
            if _is_not_found(exc):
                return None
            raise

    def delete_version(self, namespace: str, name: str, selector: str, *, now: bool) -> None:
        """Delete the Deployment and Service; with now, also the pods without a grace period."""
        for kind, delete in (("Deployment", self.apps.delete_namespaced_deployment),
                             ("Service", self.core.delete_namespaced_service)):
            try:
                with api_errors(f"delete {kind} {namespace}/{name}"):
                    delete(name, namespace, propagation_policy="Background",
                           _request_timeout=REQUEST_TIMEOUT_S)
            except DriverError as exc:
                if not _is_not_found(exc):
                    raise
        if now:
            # Deleting the Deployment lets the garbage collector remove the pods gracefully;
            # a kill must not wait for that.
            with api_errors(f"delete the pods of {namespace}/{name}"):
                self.core.delete_collection_namespaced_pod(
                    namespace, label_selector=selector, grace_period_seconds=0,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )

    def pods(self, namespace: str, selector: str) -> list[k8s.V1Pod]:
        with api_errors(f"list pods {selector} in {namespace}"):
            return self.core.list_namespaced_pod(
                namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S).items

    def pod_log(self, namespace: str, pod: str, lines: int) -> str:
        with api_errors(f"read the log of pod {namespace}/{pod}"):
            return self.core.read_namespaced_pod_log(
                pod, namespace, container=CONTAINER_NAME, tail_lines=lines,
                _request_timeout=REQUEST_TIMEOUT_S)


def _is_not_found(exc: DriverError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, ApiException) and cause.status == 404


def _pod_ready(pod: k8s.V1Pod) -> bool:
    conditions = (pod.status and pod.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _pod_url(pod: k8s.V1Pod) -> str:
    return f"http://{pod.status.pod_ip}:{PORT}"


def _log_tail_order(pod: k8s.V1Pod) -> tuple[bool, float]:
    """Not-ready pods first (their log says why), then the newest."""
    created = pod.metadata.creation_timestamp
    return _pod_ready(pod), -(created.timestamp() if created else 0.0)


def _pod_problem(pod: k8s.V1Pod) -> str:
    """Why a pod's replica container is not running well, from its container status."""
    for status in (pod.status and pod.status.container_statuses) or []:
        waiting = status.state and status.state.waiting
        if waiting and waiting.reason:
            return f"{waiting.reason}: {waiting.message or ''}".rstrip(": ")
        terminated = status.last_state and status.last_state.terminated
        if terminated:
            reason = terminated.reason or "no reason given"
            return f"last exit code {terminated.exit_code} ({reason})"
    return ""


@dataclass(frozen=True)
class VersionObjects:
    """Where one deployment version lives in the cluster."""

    namespace: str
    name: str
    deployment: str
    version: int

    @property
    def selector(self) -> str:
        return label_selector(version_labels(self.deployment, self.version))

    def identity(self) -> dict:
        return {"namespace": self.namespace, "deployment": self.name, "service": self.name,
                "version": self.version}


class KubernetesDriver:
    name = "kubernetes"

    def __init__(self, api_client: k8s.ApiClient | None = None,
                 config: KubernetesSettings | None = None):
        self.config = config or KubernetesSettings.from_django()
        self.renderer = ManifestRenderer(self.config)
        self._api_client = api_client
        self._cluster: ClusterObjects | None = None

    @cached_property
    def installation(self) -> str:
        return installation_id()

    def owner(self, found: k8s.V1Deployment | None) -> str | None:
        """The other installation that labelled this Deployment; None when it is ours or unlabelled."""
        labels = (found and found.metadata and found.metadata.labels) or {}
        theirs = labels.get(INSTALLATION_LABEL)
        return theirs if theirs and theirs != self.installation else None

    def refusal(self, objects: VersionObjects, theirs: str) -> str:
        return (f"Deployment {objects.namespace}/{objects.name} belongs to another inferops installation "
                f"({theirs}); give each installation its own namespace (INFEROPS_K8S_NAMESPACE)")

    @property
    def cluster(self) -> ClusterObjects:
        # Credentials are loaded on first use, so building a driver never needs a cluster.
        if self._cluster is None:
            self._cluster = ClusterObjects(self._api_client or load_api_client())
        return self._cluster

    def start(self, replica, spec: ReplicaSpec) -> Started:
        objects = VersionObjects(self.config.namespace, object_name(spec.deployment, spec.version),
                                 spec.deployment, spec.version)
        theirs = self.owner(self.cluster.read_deployment(objects.namespace, objects.name))
        if theirs:
            raise DriverError(self.refusal(objects, theirs))
        deployment = self.renderer.deployment(spec, replicas=self.live_replicas(replica) + 1,
                                              installation=self.installation)
        service = self.renderer.service(spec.deployment, spec.version)
        for body in (deployment, service):
            body["metadata"]["labels"][INSTALLATION_LABEL] = self.installation
        if spec.backend == "builtin":
            self.cluster.apply_secret(self.renderer.admin_secret(self.installation))
        self.cluster.apply_service(service)
        self.cluster.apply_deployment(deployment)
        return Started(url=self._url(objects), port=PORT, identity=objects.identity())

    @property
    def node(self) -> str:
        """What the reconcile loop records as a replica's node: the namespace of its pods."""
        return self.config.namespace

    def is_alive(self, replica) -> bool:
        """The version's Deployment exists and still wants pods (readiness is /health's job)."""
        objects = self._objects(replica)
        found = self.cluster.read_deployment(objects.namespace, objects.name)
        if theirs := self.owner(found):
            log.warning("replica %s: %s; not ours, left alone", replica, self.refusal(objects, theirs))
            return False
        return bool(found and found.spec and (found.spec.replicas or 0) >= 1)

    def adopt(self, replica) -> str | None:
        """Re-attach a row whose identity was lost (its worker died between start and saving).

        If the version's Deployment still runs, fill identity, url and port and return the
        Deployment's name. None when nothing was lost (no API call then, so the reconcile loop
        may ask on every pass) or when there is nothing left to adopt.
        """
        if replica.identity.get("deployment") or not self.is_alive(replica):
            return None
        objects = self._objects(replica)
        replica.identity = {**replica.identity, **objects.identity()}
        replica.url, replica.port = self._url(objects), PORT
        return objects.name

    def stop(self, replica, grace_s: float = 30, why: str = "drain") -> None:
        """Lower the version's replica count; delete its objects when no live row remains.

        Kubernetes picks which pod goes, and that pod drains for the template's
        terminationGracePeriodSeconds (set from the drain_timeout engine arg), not grace_s:
        changing the grace on the template would roll every pod of the version.
        """
        self._lower(replica, now=False)

    def kill(self, replica, why: str = "stop now") -> None:
        self._lower(replica, now=True)

    def _lower(self, replica, *, now: bool) -> None:
        objects = self._objects(replica)
        if theirs := self.owner(self.cluster.read_deployment(objects.namespace, objects.name)):
            log.warning("replica %s: %s; not scaled or deleted", replica, self.refusal(objects, theirs))
            return
        remaining = self.live_replicas(replica)
        if remaining:
            self.cluster.scale_deployment(objects.namespace, objects.name, remaining)
        else:
            self.cluster.delete_version(objects.namespace, objects.name, objects.selector, now=now)

    def log_tail(self, replica, lines: int = 50) -> str:
        """The log of one pod of the version, a pod that is not ready first (the likelier story)."""
        objects = self._objects(replica)
        try:
            pods = self.cluster.pods(objects.namespace, objects.selector)
            if not pods:
                return ""
            pods.sort(key=_log_tail_order)
            return self.cluster.pod_log(objects.namespace, pods[0].metadata.name, lines)
        except DriverError:
            return ""

    def exit_status(self, replica) -> str:
        objects = self._objects(replica)
        try:
            if self.cluster.read_deployment(objects.namespace, objects.name) is None:
                return f"Deployment {objects.namespace}/{objects.name} no longer exists"
            problems = [f"pod {pod.metadata.name}: {problem}"
                        for pod in self.cluster.pods(objects.namespace, objects.selector)
                        if (problem := _pod_problem(pod))]
        except DriverError as exc:
            return str(exc)
        return "; ".join(problems) or f"Deployment {objects.namespace}/{objects.name} has no pods"

    def ready_pod_urls(self, replica) -> list[str]:
        """Base URLs of the version's ready pods.

        The Service URL reaches one pod at random per request; a scraper that must see every
        pod's own counters (and never mistake another pod's for a reset) asks for these instead.
        """
        return sorted(_pod_url(pod) for pod in self._ready_pods(replica))

    def scrape_pods(self, replica) -> list[tuple[str, GpuSource | None]]:
        """The version's ready pods (as ready_pod_urls) with where each one's GPU series are, for
        a deployment that holds GPUs: the dcgm-exporter on the pod's node, filtered to the pod."""
        pods = self._ready_pods(replica)
        if not pods or not (replica.deployment.resources or {}).get("gpu_count"):
            return [(url, None) for url in sorted(_pod_url(pod) for pod in pods)]
        exporters, error = self._dcgm_exporters
        sources = []
        for pod in pods:
            node = pod.spec.node_name if pod.spec else None
            url = exporters.get(node or "")
            source = (GpuSource(url=url, pod=pod.metadata.name, namespace=pod.metadata.namespace) if url else
                      GpuSource(error=error or f"no ready dcgm-exporter pod ({self.config.dcgm_selector} in "
                                               f"namespace {self.config.dcgm_namespace}) on node {node}"))
            sources.append((_pod_url(pod), source))
        return sorted(sources, key=lambda pair: pair[0])

    @cached_property
    def _dcgm_exporters(self) -> tuple[dict[str, str], str]:
        """dcgm-exporter's base URL on each node, and why there are none when its pods could not be
        listed. Listed once per driver object: the scraper makes one a cycle."""
        config = self.config
        try:
            pods = self.cluster.pods(config.dcgm_namespace, config.dcgm_selector)
        except DriverError as exc:
            return {}, f"listing the dcgm-exporter pods: {exc}"
        return {pod.spec.node_name: f"http://{pod.status.pod_ip}:{config.dcgm_port}" for pod in pods
                if _pod_ready(pod) and pod.status.pod_ip and pod.spec and pod.spec.node_name}, ""

    def _ready_pods(self, replica) -> list[k8s.V1Pod]:
        objects = self._objects(replica)
        return [pod for pod in self.cluster.pods(objects.namespace, objects.selector)
                if _pod_ready(pod) and pod.status.pod_ip]

    def live_replicas(self, replica) -> int:
        """Live rows of replica's deployment version on this driver, not counting replica itself."""
        return (
            Replica.objects.filter(
                deployment_id=replica.deployment_id, version_id=replica.version_id,
                driver=replica.driver, state__in=ReplicaState.live(),
            ).exclude(pk=replica.pk).count()
        )

    def _url(self, objects: VersionObjects) -> str:
        return service_url(objects.name, objects.namespace, self.config.cluster_domain)

    def _objects(self, replica) -> VersionObjects:
        identity = replica.identity or {}
        deployment, version = replica.deployment.name, replica.version.number
        if identity.get("deployment"):
            namespace, name = identity["namespace"], identity["deployment"]
        else:
            namespace, name = self.config.namespace, object_name(deployment, version)
        return VersionObjects(namespace, name, deployment, version)

