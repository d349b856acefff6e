"""vLLM's options as vLLM's own parser states them, and the command line built from engine_args.

The options file (deployments/vllm_options.json) is checked against the installed vLLM when
`make vllm` has made one; elsewhere that one test is skipped and the rest use the file as
checked in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import engine_args
from deployments.models import Deployment
from deployments.replicas.drivers.base import ReplicaSpec
from deployments.replicas.drivers.local import replica_command, vllm_missing, vllm_python

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
def test_the_options_file_matches_the_installed_vllm(settings):
    # vLLM pins conflict with the project's, so its parser is read in vLLM's own environment.
    result = subprocess.run([vllm_python(), str(ROOT / "platform" / "vllm_options.py"), "--check"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_options_file_says_which_vllm_it_came_from():
    known = engine_args.vllm_options()
    assert known["vllm_version"].split(".")[:2] == ["0", "32"]
    options = known["options"]
    # What deployments use most, with the kinds vLLM's parser gives them.
    assert options["enable_prefix_caching"] == {"type": "bool", "negatable": True}
    assert options["max_num_seqs"]["type"] == "int"
    assert options["gpu_memory_utilization"]["type"] == "float"
    assert "float16" in options["dtype"]["choices"]
    assert not set(engine_args.MANAGED_BY_INFEROPS - {"admin_token"}) - set(options)  # set by the driver


def test_false_turns_a_vllm_boolean_off_instead_of_being_dropped():
    argv = engine_args.to_argv({"enable_prefix_caching": False, "enforce_eager": True, "max_num_seqs": 8,
                                "hf_overrides": {"rope_theta": 1e6}, "lora_modules": ["a=/l/a", "b=/l/b"]},
                               "vllm")
    assert argv == ["--no-enable-prefix-caching", "--enforce-eager", "--max-num-seqs", "8",
                    "--hf-overrides", '{"rope_theta":1000000.0}', "--lora-modules", "a=/l/a", "b=/l/b"]
    # A store_true flag has no --no- form: false is its default, so it is left out.
    assert engine_args.to_argv({"disable_log_stats": False}, "vllm") == []
    # The built-in engine's flags are all store_true.
    assert engine_args.to_argv({"no_prefix_caching": False, "max_num_seqs": 4}) == ["--max-num-seqs", "4"]


def test_the_local_driver_runs_vllm_serve_with_the_flags(settings):
    settings.INFEROPS_VLLM_PYTHON = sys.executable
    spec = ReplicaSpec(deployment="chat", version=1, model_path="/models/x", backend="vllm",
                       engine_args={"enable_prefix_caching": False, "max_model_len": "4k"})
    assert replica_command(spec, "127.0.0.1", 8100) == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/x",
        "--served-model-name", "chat", "--host", "127.0.0.1", "--port", "8100",
        "--no-enable-prefix-caching", "--max-model-len", "4k"]


@pytest.mark.vllm
def test_the_command_line_parses_in_the_installed_vllm(settings):
    """The argv the driver builds, given to vLLM's own parser (no server is started)."""
    spec = ReplicaSpec(deployment="chat", version=1, model_path="/models/x", backend="vllm",
                       engine_args={"enable_prefix_caching": False, "enforce_eager": True, "max_model_len": "4k",
                                    "hf_overrides": {"rope_theta": 1e6}, "dtype": "float32"})
    argv = replica_command(spec, "127.0.0.1", 8100)
    script = ("import sys, json\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "from vllm_options import server_parser\n"
              "a = server_parser().parse_args(sys.argv[2:])\n"
              "print(json.dumps({k: getattr(a, k) for k in "
              "('enable_prefix_caching', 'enforce_eager', 'max_model_len', 'hf_overrides', 'port')}))")
    result = subprocess.run([argv[0], "-c", script, str(ROOT / "platform"), *argv[3:]],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    # vLLM reads "4k" as 4000 ("4K" would be 4096).
    assert parsed == {"enable_prefix_caching": False, "enforce_eager": True, "max_model_len": 4000,
                      "hf_overrides": {"rope_theta": 1e6}, "port": 8100}


@pytest.mark.parametrize("args,key,fragment", [
    ({"swap_space": 4}, "swap_space", "vLLM 0.32.0 has no --swap-space"),
    ({"disable_log_requests": True}, "disable_log_requests", "did you mean enable_log_requests"),
    ({"enable_prefix_cachng": True}, "enable_prefix_cachng", "did you mean enable_prefix_caching"),
    ({"max_num_seqs": "many"}, "max_num_seqs", "must be an integer"),
    ({"max_model_len": 1.5}, "max_model_len", "must be an integer (or text"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching", "true or false"),
    ({"dtype": "float8"}, "dtype", "must be one of auto"),
    ({"hf_overrides": 3}, "hf_overrides", "object"),
    ({"api_key": "secret"}, "api_key", "without a key"),
    ({"port": 9000}, "port", "set by inferops"),
])
def test_vllm_options_are_refused_by_name(args, key, fragment):
    with pytest.raises(engine_args.EngineArgsError) as caught:
        engine_args.validate("vllm", args)
    assert fragment in caught.value.errors[key]


def test_what_vllm_accepts_passes():
    args = {"max_model_len": "32k", "max_num_seqs": 64, "gpu_memory_utilization": 0.85, "dtype": "bfloat16",
            "enable_prefix_caching": False, "compilation_config": {"mode": 3}, "lora_modules": ["a=/x"]}
    assert engine_args.validate("vllm", args) == args


@pytest.mark.django_db
def test_a_removed_option_is_a_400_naming_it(api, tiny_llama_dir, settings, make_user):
    from registry import services as registry_services

    settings.INFEROPS_VLLM_PYTHON = sys.executable  # availability is not what this test is about
    model = registry_services.model_create(name="tiny", task="generate", actor=make_user("operator"))
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    response = api("operator").post("/api/v1/deployments/", {
        "name": "chat", "model": "tiny", "version": 1, "backend": "vllm",
        "engine_args": {"swap_space": 4, "disable_log_requests": True, "max_num_seqs": 8}}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["engine_args"]
    assert len(errors) == 2 and errors[0].startswith("swap_space: ") and errors[1].startswith("disable_log_requests: ")
    assert not Deployment.objects.exists()


@pytest.mark.django_db
def test_no_vllm_is_a_400_saying_how_to_get_one(api, tiny_llama_dir, settings, make_user, tmp_path, monkeypatch):
    from registry import services as registry_services

    # Nothing where the driver looks: no setting, no .venv-vllm at the top of the checkout, no vllm on PATH.
    settings.INFEROPS_VLLM_PYTHON = ""
    settings.BASE_DIR = tmp_path
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    model = registry_services.model_create(name="tiny", task="generate", actor=make_user("operator"))
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    client = api("operator")
    body = {"name": "chat", "model": "tiny", "version": 1, "backend": "vllm"}
    response = client.post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 400, response.content
    assert "make vllm" in response.json()["backend"][0]
    # A path the operator names is the worker's: the web process may not see it, so it is trusted.
    settings.INFEROPS_VLLM_PYTHON = "/opt/vllm/bin/python"
    assert vllm_python() == "/opt/vllm/bin/python" and vllm_missing() is None
    # `make vllm`'s environment is found without any setting.
    made = tmp_path / ".venv-vllm" / "bin" / "python"
    made.parent.mkdir(parents=True)
    made.symlink_to(sys.executable)
    settings.INFEROPS_VLLM_PYTHON = ""
    assert vllm_python() == str(made)
    assert client.post("/api/v1/deployments/", body, format="json").status_code == 201
    # Kubernetes runs vLLM's image, so nothing local is needed there.
    made.unlink()
    response = client.post("/api/v1/deployments/", {**body, "name": "k8s", "driver": "kubernetes"}, format="json")
    assert response.status_code == 201, response.content


def test_scheduling_policy_and_slo_targets_are_engine_args_of_a_builtin_deployment():
    args = {"scheduling_policy": "slo", "slo_reject_late": True, "slo_ttft_ms": 1500, "slo_tpot_ms": 150}
    assert engine_args.validate("builtin", args) == args
    assert engine_args.to_argv(args) == ["--scheduling-policy", "slo", "--slo-reject-late",
                                         "--slo-ttft-ms", "1500", "--slo-tpot-ms", "150"]
    with pytest.raises(engine_args.EngineArgsError) as refused:
        engine_args.validate("builtin", {"scheduling_policy": "edf", "slo_ttft_ms": 0})
    assert set(refused.value.errors) == {"scheduling_policy", "slo_ttft_ms"}
    assert "fcfs" in refused.value.errors["scheduling_policy"]
