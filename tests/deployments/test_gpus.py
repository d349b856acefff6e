"""GPU deployments: memory arithmetic, the refusals at creation, and each replica's own devices.

No GPU exists on the development machines. Device assignment is tested on real replica processes
(the stand-in vLLM of test_local_driver, a script that sleeps) whose CUDA_VISIBLE_DEVICES is read
back from /proc; the node's GPU list comes from INFEROPS_NODE_GPUS, as an operator would set it.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from deployments import gpus
from deployments.models import Deployment
from deployments.replicas.drivers.base import ReplicaSpec
from deployments.replicas.drivers.local import LocalProcessDriver, NoFreeGpus, replica_env
from registry import services as registry_services
from registry.models import ModelVersion
from tests.deployments.test_local_driver import environ_of, server_pid, sleeper

GIB = 1024 ** 3
# Llama-3-8B in bf16: 16 GB of weights, 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes per token.
LLAMA_8B = SimpleNamespace(weight_bytes=16_060_522_496, kv_cache_bytes_per_token=131_072, max_context=8192)


def need(engine_args, gpu_type="nvidia-l4", gpu_count=1, backend="vllm"):
    return gpus.memory_need(weight_bytes=LLAMA_8B.weight_bytes, kv_bytes_per_token=LLAMA_8B.kv_cache_bytes_per_token,
                            max_context=LLAMA_8B.max_context, engine_args=engine_args, gpu_type=gpu_type,
                            gpu_count=gpu_count, backend=backend)


def test_weights_plus_the_kv_cache_of_every_sequence_at_full_context():
    one = need({})  # no max_num_seqs: one sequence of the version's full context
    assert one.kv_bytes == 131_072 * 8192 == 1 * GIB
    assert one.needed_bytes == LLAMA_8B.weight_bytes + GIB
    assert one.available_bytes == int(23034 * 1024 ** 2 * 0.9)  # vLLM keeps 10% back by default
    assert one.fits
    many = need({"max_num_seqs": 64})
    assert many.kv_bytes == 64 * GIB and not many.fits
    assert need({"max_num_seqs": 64, "max_model_len": 256}).kv_bytes == 64 * 256 * 131_072
    # gpu_memory_utilization and the GPU count scale what is available.
    assert need({}, gpu_type="nvidia-h100", gpu_count=2).available_bytes == int(2 * 81559 * 1024 ** 2 * 0.9)
    assert need({"gpu_memory_utilization": 0.5}, gpu_type="nvidia-h100").available_bytes == int(
        81559 * 1024 ** 2 * 0.5)
    # The built-in engine on a GPU keeps the same 10 % back (its --gpu-memory-utilization).
    assert need({}, backend="builtin").available_bytes == int(23034 * 1024 ** 2 * 0.9)


def test_the_check_names_the_field_and_gives_the_bytes():
    errors = gpus.check(version=LLAMA_8B, backend="vllm", engine_args={"max_num_seqs": 64},
                        resources={"gpu_type": "nvidia-l4", "gpu_count": 1})
    (message,) = errors["resources"]
    assert f"needs {LLAMA_8B.weight_bytes + 64 * GIB} bytes" in message
    assert f"give {int(23034 * 1024 ** 2 * 0.9)} bytes" in message and "max_num_seqs 64 x 8192 tokens" in message
    assert gpus.check(version=LLAMA_8B, backend="vllm", engine_args={"max_num_seqs": 64, "tensor_parallel_size": 2},
                      resources={"gpu_type": "H100", "gpu_count": 2}) == {}  # 2 x 80 GiB hold it
    # A type not in the table is accepted (a node label may name any product) but not checked.
    assert gpus.check(version=LLAMA_8B, backend="vllm", engine_args={"max_num_seqs": 4096},
                      resources={"gpu_type": "acme-x1", "gpu_count": 1}) == {}
    assert gpus.check(version=LLAMA_8B, backend="vllm", engine_args={"max_num_seqs": 4096}, resources={}) == {}


@pytest.mark.parametrize("engine_args,gpu_count,fragment", [
    ({}, 2, "tensor_parallel_size (1) must equal resources.gpu_count (2)"),
    ({"tensor_parallel_size": 4}, 2, "tensor_parallel_size (4) must equal resources.gpu_count (2)"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2, "x pipeline_parallel_size (2)"),
])
def test_tensor_parallel_size_must_match_the_gpu_count(engine_args, gpu_count, fragment):
    errors = gpus.check(version=LLAMA_8B, backend="vllm", engine_args=engine_args,
                        resources={"gpu_type": "nvidia-h100", "gpu_count": gpu_count})
    assert fragment in errors["engine_args"][0]


@pytest.mark.parametrize("engine_args,gpu_count,fragment", [
    ({"device": "cuda"}, 0, "device cuda needs resources.gpu_count 1"),
    ({"device": "cuda:0"}, 0, "device cuda:0 needs resources.gpu_count 1"),
    ({}, 2, "the built-in engine runs on one GPU, not resources.gpu_count 2"),
    ({"device": "cuda"}, 2, "runs on one GPU"),
    ({"device": "cpu"}, 1, "device cpu with resources.gpu_count 1 would leave the GPU idle"),
])
def test_the_builtin_engine_runs_on_the_cpu_or_on_the_one_gpu_it_is_given(engine_args, gpu_count, fragment):
    errors = gpus.check(version=LLAMA_8B, backend="builtin", engine_args=engine_args,
                        resources={"gpu_count": gpu_count})
    assert fragment in errors["engine_args"][0]


def test_a_builtin_replica_given_a_gpu_runs_on_it_unless_told():
    from deployments.replicas.drivers.base import ReplicaSpec

    def run_args(backend="builtin", **resources_and_args):
        gpu_count = resources_and_args.pop("gpu_count", 0)
        return ReplicaSpec("chat", 1, "/m", backend, engine_args=resources_and_args,
                           resources={"gpu_count": gpu_count}).run_args

    assert run_args(gpu_count=1, max_num_seqs=8) == {"max_num_seqs": 8, "device": "cuda"}
    assert run_args(gpu_count=1, device="cuda:0") == {"device": "cuda:0"}
    assert run_args(max_num_seqs=8) == {"max_num_seqs": 8}  # no GPU: the CPU
    assert run_args("vllm", gpu_count=1) == {}  # vLLM finds its GPUs itself
    for engine_args in ({}, {"device": "cuda"}):
        assert gpus.check(version=LLAMA_8B, backend="builtin", engine_args=engine_args,
                          resources={"gpu_type": "nvidia-h200", "gpu_count": 1}) == {}
    assert gpus.check(version=LLAMA_8B, backend="builtin", engine_args={"device": "cpu"}, resources={}) == {}


@pytest.fixture
def big_model(make_user, tiny_llama_dir, settings):
    settings.INFEROPS_VLLM_PYTHON = sys.executable  # vLLM's presence is test_engine_args' concern
    model = registry_services.model_create(name="big", task="generate", actor=make_user("operator"))
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    # The registry reads these from the checkpoint; a real 8B checkpoint is no test fixture.
    ModelVersion.objects.filter(model=model).update(**vars(LLAMA_8B))
    return model


@pytest.mark.django_db
@pytest.mark.parametrize("body,field,fragment", [
    ({"engine_args": {"max_num_seqs": 64}, "resources": {"gpu_type": "nvidia-l4", "gpu_count": 1}},
     "resources", f"big v1 does not fit: needs {LLAMA_8B.weight_bytes + 64 * GIB} bytes"),
    ({"engine_args": {"max_num_seqs": 8}, "resources": {"gpu_type": "nvidia-h100", "gpu_count": 2}},
     "engine_args", "tensor_parallel_size (1) must equal resources.gpu_count (2)"),
])
def test_gpu_refusals_are_400s_naming_the_field(api, big_model, body, field, fragment):
    response = api("operator").post("/api/v1/deployments/", {"name": "chat", "model": "big", "version": 1,
                                                             "backend": "vllm", **body}, format="json")
    assert response.status_code == 400, response.content
    assert fragment in response.json()[field][0], response.json()
    assert not Deployment.objects.exists()


def create_chat_that_fits(client) -> None:
    """`chat` of `big` on one L40S at max_num_seqs 4: its KV cache fits beside the weights."""
    response = client.post("/api/v1/deployments/", {
        "name": "chat", "model": "big", "version": 1, "backend": "vllm", "engine_args": {"max_num_seqs": 4},
        "resources": {"gpu_type": "nvidia-l40s", "gpu_count": 1}}, format="json")
    assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_a_change_that_no_longer_fits_is_refused(api, big_model):
    client = api("operator")
    create_chat_that_fits(client)
    response = client.patch("/api/v1/deployments/chat/", {"engine_args": {"max_num_seqs": 256}}, format="json")
    assert response.status_code == 400 and "does not fit" in response.json()["resources"][0]
    assert Deployment.objects.get().engine_args == {"max_num_seqs": 4}


def test_the_environment_names_only_the_assigned_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the worker's own: not for a replica
    spec = ReplicaSpec(deployment="chat", version=1, model_path="/m", backend="builtin")
    assert replica_env(spec, "i/1", ["2", "3"])["CUDA_VISIBLE_DEVICES"] == "2,3"
    # Given none, it sees none: not the worker's four (it would report their telemetry as its own).
    assert replica_env(spec, "i/1", None)["CUDA_VISIBLE_DEVICES"] == ""


def gpu_spec(count: int) -> ReplicaSpec:
    return ReplicaSpec(deployment="chat", version=1, model_path="/models/x", backend="vllm",
                       engine_args={"tensor_parallel_size": count},
                       resources={"gpu_type": "nvidia-h100", "gpu_count": count})


@pytest.mark.django_db
def test_replicas_on_one_node_get_their_own_gpus(settings, tmp_path):
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    settings.INFEROPS_DATA_DIR = tmp_path / "data"
    settings.INFEROPS_NODE_GPUS = "0,1,2"
    driver = LocalProcessDriver(log_dir=tmp_path / "logs")
    first, second, third = (SimpleNamespace(pk=pk, identity={}, log_path="") for pk in (9101, 9102, 9103))

    def start(replica, count):
        started = driver.start(replica, gpu_spec(count))
        replica.identity, replica.log_path = started.identity, started.log_path
        return environ_of(server_pid(started.identity["pid"]))["CUDA_VISIBLE_DEVICES"]

    try:
        assert start(first, 2) == "0,1" and first.identity["gpus"] == ["0", "1"]
        with pytest.raises(NoFreeGpus, match=r"needs 2 GPU\(s\) but node .* has 1 free of 3 .*0 by replica 9101"):
            driver.start(second, gpu_spec(2))
        assert start(third, 1) == "2"
        # A worker that restarts reads the same ledger: the devices stay taken.
        assert LocalProcessDriver(log_dir=tmp_path / "logs").gpu_ledger.read() == {
            "0": f"{driver.installation}/9101", "1": f"{driver.installation}/9101", "2": f"{driver.installation}/9103"}
        driver.kill(first)  # its process is gone, so its devices are free again
        driver.kill(third)
        assert start(third, 1) == "2"  # a restarted replica gets its own device back, not the lowest free
        assert start(second, 2) == "0,1"
    finally:
        for replica in (first, second, third):
            driver.kill(replica)


@pytest.mark.django_db(transaction=True)
def test_a_replica_without_free_gpus_waits_pending_with_the_reason(settings, tmp_path, big_model, make_user):
    from deployments import services as deployment_services
    from deployments.choices import ReplicaState
    from deployments.models import Replica
    from deployments.replicas.reconcile import reconcile_deployment

    ModelVersion.objects.filter(model=big_model).update(weight_bytes=4)  # fits one GPU, so it gets through
    settings.INFEROPS_VLLM_PYTHON = str(sleeper(tmp_path))
    settings.INFEROPS_DATA_DIR = tmp_path / "data"
    settings.INFEROPS_NODE_GPUS = "0"
    deployment = deployment_services.deployment_create(
        name="chat", model=big_model, version=1, backend="vllm", replicas=2,
        actor=make_user("operator", username="deployer"), engine_args={"max_num_seqs": 1},
        resources={"gpu_type": "nvidia-h100", "gpu_count": 1})
    try:
        reconcile_deployment(deployment.pk)
        running, waiting = Replica.objects.filter(deployment=deployment).order_by("pk")
        assert running.state == ReplicaState.STARTING and running.identity["gpus"] == ["0"]
        assert waiting.state == ReplicaState.PENDING and waiting.restarts == 0 and not waiting.crash_looping
        assert waiting.last_error.startswith("waiting: needs 1 GPU(s) but node")
        assert f"0 by replica {running.pk}" in waiting.last_error
    finally:
        for replica in Replica.objects.filter(deployment=deployment):
            LocalProcessDriver().kill(replica)


@pytest.mark.django_db
def test_a_rollout_to_a_version_that_does_not_fit_is_refused(api, big_model):
    client = api("operator")
    create_chat_that_fits(client)
    response = client.post("/api/v1/deployments/chat/rollouts/", {"engine_args": {"max_num_seqs": 512}},
                           format="json")
    assert response.status_code == 400, response.content
    assert "does not fit" in response.json()["resources"][0]


def test_both_drivers_start_a_builtin_replica_given_a_gpu_with_device_cuda(settings):
    from deployments.replicas.drivers.base import ReplicaSpec
    from deployments.replicas.drivers.kubernetes import KubernetesSettings, ManifestRenderer
    from deployments.replicas.drivers.local import replica_command

    spec = ReplicaSpec("chat", 1, "/models/chat", "builtin", engine_args={"max_num_seqs": 8},
                       resources={"gpu_type": "nvidia-h200", "gpu_count": 1})
    argv = replica_command(spec, "127.0.0.1", 9000)
    assert argv[argv.index("--device") + 1] == "cuda"
    _, _, args = ManifestRenderer(KubernetesSettings(models_root="/models")).container_command(spec)
    assert args[args.index("--device") + 1] == "cuda"
