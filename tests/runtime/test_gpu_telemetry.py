"""GPU telemetry through NVML, exported under dcgm-exporter's names (runtime/gpu_telemetry.py).

The machine these tests were written on has no GPU and no libnvidia-ml, so they run against
recorded NVML answers replayed by `ReplayNvml`: tests/fixtures/nvml/h100-x2.json, two H100 80GB
HBM3, was written by hand in the format `python -m runtime.gpu_telemetry --record` writes, and is
to be replaced by that command's output on a real GPU node (with the expected values below).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from runtime import gpu_telemetry
from runtime.gpu_telemetry import GpuCollector, GpuSample, ReplayNvml, read_gpus, record, render_dcgm

RECORDING = Path(__file__).resolve().parents[1] / "fixtures/nvml/h100-x2.json"
UUID0 = "GPU-4b2e9c1a-7f3d-5e8b-a1c6-2d9f0e7b3a45"
UUID1 = "GPU-9e1f3d7c-2a6b-4c8e-b5d0-7f4a1c3e9b62"
H100 = "NVIDIA H100 80GB HBM3"
SERIES = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE",
          "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK"}
NO_LIBRARY = {"format": 1, "nvmlInit": {"error": "NVMLError_LibraryNotFound", "code": 12,
                                        "message": "NVML Shared Library Not Found"}}


def recording() -> dict:
    return json.loads(RECORDING.read_text())


class CountingReplay(ReplayNvml):
    """A replay that counts nvmlInit calls (NVML must be started once per process, not per scrape)."""

    inits = 0

    def nvmlInit(self) -> None:  # noqa: N802
        self.inits += 1
        super().nvmlInit()


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="runtime.gpu_telemetry")
    return caplog


def test_read_gpus_converts_nvml_units():
    """mW -> W, bytes -> whole MiB (as DCGM reports frame buffer sizes), names and UUIDs as text."""
    assert read_gpus(nvml=ReplayNvml(RECORDING)) == [
        GpuSample(index=0, uuid=UUID0, name=H100, util_percent=97.0, fb_used_mib=73427.0, fb_free_mib=8131.0,
                  fb_total_mib=81559.0, power_watts=652.311, temp_c=67.0, sm_clock_mhz=1980.0),
        GpuSample(index=1, uuid=UUID1, name=H100, util_percent=34.0, fb_used_mib=18211.0, fb_free_mib=63347.0,
                  fb_total_mib=81559.0, power_watts=312.456, temp_c=41.0, sm_clock_mhz=1755.0),
    ]


def test_names_answered_as_bytes_are_decoded():
    class OldPynvml(ReplayNvml):  # pynvml before 11.5 answered bytes
        def nvmlDeviceGetName(self, handle):  # noqa: N802
            return super().nvmlDeviceGetName(handle).encode()

        def nvmlDeviceGetUUID(self, handle):  # noqa: N802
            return super().nvmlDeviceGetUUID(handle).encode()

    (sample,) = read_gpus(["0"], nvml=OldPynvml(RECORDING))
    assert (sample.uuid, sample.name) == (UUID0, H100)


@pytest.mark.parametrize(("visible", "indexes"), [
    ("1", [1]),
    ("1,0", [1, 0]),  # CUDA's order, with NVML's indexes as labels
    (UUID1, [1]),
    ("GPU-9e1f3d7c", [1]),  # CUDA takes a unique prefix of a UUID
    (f"{UUID1},0", [1, 0]),
    ("0,7,1", [0]),  # CUDA ignores the entries after one it cannot resolve
    ("GPU-", []),  # a prefix of both: ambiguous
    ("", []),
])
def test_devices_follow_cuda_visible_devices(monkeypatch, visible, indexes):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [sample.index for sample in read_gpus(nvml=ReplayNvml(RECORDING))] == indexes
    assert [sample.index for sample in read_gpus(visible.split(","), nvml=ReplayNvml(RECORDING))] == indexes


def test_without_cuda_visible_devices_every_device_is_read(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [sample.uuid for sample in read_gpus(nvml=ReplayNvml(RECORDING))] == [UUID0, UUID1]


def test_render_dcgm_has_dcgm_exporters_names_labels_and_values():
    text = render_dcgm(read_gpus(nvml=ReplayNvml(RECORDING)), hostname="gpu-node-7")
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert set(families) == SERIES
    assert {family.type for family in families.values()} == {"gauge"}
    values = {(sample.name, sample.labels["gpu"]): sample.value
              for family in families.values() for sample in family.samples}
    assert values == {
        ("DCGM_FI_DEV_GPU_UTIL", "0"): 97.0, ("DCGM_FI_DEV_GPU_UTIL", "1"): 34.0,
        ("DCGM_FI_DEV_FB_USED", "0"): 73427.0, ("DCGM_FI_DEV_FB_USED", "1"): 18211.0,
        ("DCGM_FI_DEV_FB_FREE", "0"): 8131.0, ("DCGM_FI_DEV_FB_FREE", "1"): 63347.0,
        ("DCGM_FI_DEV_POWER_USAGE", "0"): 652.311, ("DCGM_FI_DEV_POWER_USAGE", "1"): 312.456,
        ("DCGM_FI_DEV_GPU_TEMP", "0"): 67.0, ("DCGM_FI_DEV_GPU_TEMP", "1"): 41.0,
        ("DCGM_FI_DEV_SM_CLOCK", "0"): 1980.0, ("DCGM_FI_DEV_SM_CLOCK", "1"): 1755.0,
    }
    labels = {tuple(sorted(sample.labels.items())) for family in families.values() for sample in family.samples}
    assert labels == {
        (("Hostname", "gpu-node-7"), ("UUID", UUID0), ("device", "nvidia0"), ("gpu", "0"), ("modelName", H100)),
        (("Hostname", "gpu-node-7"), ("UUID", UUID1), ("device", "nvidia1"), ("gpu", "1"), ("modelName", H100)),
    }


def test_hostname_is_node_name_when_set_as_dcgm_exporter_chooses_it(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "k8s-gpu-3")
    families = text_string_to_metric_families(render_dcgm(read_gpus(["0"], nvml=ReplayNvml(RECORDING))))
    assert {sample.labels["Hostname"] for family in families for sample in family.samples} == {"k8s-gpu-3"}


def test_no_nvml_library_gives_no_devices_and_one_warning(warnings):
    nvml = CountingReplay(NO_LIBRARY)
    assert read_gpus(nvml=nvml) == []
    assert read_gpus(nvml=nvml) == []
    assert list(GpuCollector(nvml=nvml).collect()) == []
    assert nvml.inits == 1  # remembered as unavailable: a scrape costs nothing
    assert [record.getMessage() for record in warnings.records] == [
        "no GPU telemetry: NVML did not start (NVMLError_LibraryNotFound: NVML Shared Library Not Found)"]


def test_no_pynvml_package_gives_no_devices_and_one_warning(monkeypatch, warnings):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(gpu_telemetry, "_sessions", {})
    assert read_gpus() == [] and read_gpus() == []
    assert [record.getMessage() for record in warnings.records] == [
        "no GPU telemetry: the nvidia-ml-py package (pynvml) is not installed"]


def test_a_field_the_device_refuses_is_left_out_of_that_device_only(warnings):
    refusing = recording()
    refusing["devices"][1]["nvmlDeviceGetPowerUsage"] = {"error": "NVMLError_NotSupported", "code": 3,
                                                         "message": "Not Supported"}
    nvml = ReplayNvml(refusing)
    first, second = read_gpus(nvml=nvml), read_gpus(nvml=nvml)
    assert first == second
    assert [sample.power_watts for sample in first] == [652.311, None]
    assert (first[1].util_percent, first[1].fb_used_mib, first[1].temp_c, first[1].sm_clock_mhz) == \
        (34.0, 18211.0, 41.0, 1755.0)
    families = {family.name: family for family in text_string_to_metric_families(render_dcgm(first, "h"))}
    assert [sample.labels["gpu"] for sample in families["DCGM_FI_DEV_POWER_USAGE"].samples] == ["0"]
    assert [sample.labels["gpu"] for sample in families["DCGM_FI_DEV_GPU_TEMP"].samples] == ["0", "1"]
    assert [record.getMessage() for record in warnings.records] == [
        "GPU telemetry: NVML gave no power of GPU 1 (NVMLError_NotSupported: Not Supported); left out"]


def test_a_device_without_a_uuid_is_left_out():
    lost = recording()
    lost["devices"][0]["nvmlDeviceGetUUID"] = {"error": "NVMLError_GpuIsLost", "code": 15, "message": "GPU is lost"}
    assert [sample.index for sample in read_gpus(nvml=ReplayNvml(lost))] == [1]


def test_record_writes_what_replay_answers(tmp_path):
    """A recording of the replayed devices is the recording itself: one format for both."""
    written = record(tmp_path / "out.json", nvml=ReplayNvml(RECORDING))
    expected = recording()
    del expected["_comment"]
    assert json.loads((tmp_path / "out.json").read_text()) == written == expected


def test_record_without_nvml_records_the_failed_start(tmp_path):
    record(tmp_path / "out.json", nvml=ReplayNvml(NO_LIBRARY))
    assert json.loads((tmp_path / "out.json").read_text()) == NO_LIBRARY
    assert read_gpus(nvml=ReplayNvml(tmp_path / "out.json")) == []


# -- the replica's /metrics -------------------------------------------------------------------------

def replica_metrics(tiny_llama_dir, gpu_collector) -> str:
    """The /metrics of a real replica (the tiny Llama on the CPU) after one completion."""
    from runtime.engine.async_engine import AsyncEngine
    from runtime.engine.config import EngineConfig
    from runtime.engine.engine import LLMEngine
    from runtime.engine.server import ReplicaServer, ServerSettings
    from tests.runtime.engine.replica_http import MAX_MODEL_LEN, MODEL, wait_ready

    def load():
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128,
                                      max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN))

    replica = ReplicaServer(AsyncEngine(load), ServerSettings(served_model_name=MODEL, model_root="/models/tiny"),
                            gpu_collector=gpu_collector)
    with TestClient(replica.build_app(), raise_server_exceptions=False) as client:
        wait_ready(client)
        assert client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 2}).status_code == 200
        return client.get("/metrics").text


def test_a_gpu_replica_serves_the_dcgm_series(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the replica holds the second device only
    text = replica_metrics(tiny_llama_dir, GpuCollector(nvml=ReplayNvml(RECORDING), hostname="gpu-node-7"))
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert SERIES <= set(families) and "vllm:time_to_first_token_seconds" in families
    (util,) = families["DCGM_FI_DEV_GPU_UTIL"].samples
    assert util.labels == {"gpu": "1", "UUID": UUID1, "device": "nvidia1", "modelName": H100,
                           "Hostname": "gpu-node-7"}
    assert util.value == 34.0
    (power,) = families["DCGM_FI_DEV_POWER_USAGE"].samples
    assert power.value == 312.456


def test_a_cpu_replica_serves_no_dcgm_series(tiny_llama_dir):
    """What a CPU replica's pynvml answers: no NVML library."""
    text = replica_metrics(tiny_llama_dir, GpuCollector(nvml=ReplayNvml(NO_LIBRARY)))
    assert "vllm:num_requests_running" in text
    assert "DCGM_" not in text


def live_cuda_reason() -> str | None:
    from runtime.engine.plan import cuda_unavailable_reason

    return cuda_unavailable_reason(None)


@pytest.mark.gpu
@pytest.mark.skipif(live_cuda_reason() is not None, reason=f"the live NVML test: {live_cuda_reason()}")
def test_the_live_devices_answer_through_nvml():
    """On a GPU machine (make gpu-check): NVML itself, not a recording."""
    import torch

    samples = read_gpus()
    assert len(samples) == torch.cuda.device_count()
    assert {s.name for s in samples} == {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    for sample in samples:
        assert sample.uuid.startswith("GPU-") and sample.fb_total_mib > 1024
        assert sample.fb_used_mib + sample.fb_free_mib <= sample.fb_total_mib + 1
        assert 0 <= sample.util_percent <= 100 and 0 < sample.temp_c < 120 and sample.sm_clock_mhz > 0
    families = {f.name: f for f in text_string_to_metric_families(render_dcgm(samples))}
    assert len(families["DCGM_FI_DEV_FB_USED"].samples) == len(samples)
