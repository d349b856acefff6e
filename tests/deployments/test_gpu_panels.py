"""The deployment page's GPU charts and model FLOPs utilisation, from replica minute rows with and
without GPU telemetry (how those rows are scraped: test_gpu_telemetry.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.gpus import GPU_MEMORY_BYTES, PEAK_DENSE_BF16_TFLOPS, parameters, peak_flops
from deployments.models import Deployment, Replica, ReplicaMetricsMinute
from deployments.replicas.metrics_query import deployment_series, mfu_facts, mfu_summary
from registry.models import ModelVersion, RegisteredModel

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(minutes=30)).replace(second=0, microsecond=0)
LLAMA_8B = 8_030_261_248  # Llama 3 8B's parameters
H100 = {"gpu_type": "nvidia-h100", "gpu_count": 2}


def version(model, number: int, *, parameter_count: int = LLAMA_8B, weight_bytes: int = 2 * LLAMA_8B,
            dtype: str = "bfloat16") -> ModelVersion:
    return ModelVersion.objects.create(
        model=model, number=number, artifact_uri="/nowhere", digest=f"{number}" * 64, architecture="LlamaForCausalLM",
        parameter_count=parameter_count, hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
        head_dim=128, vocab_size=128256, max_context=8192, dtype=dtype, weight_bytes=weight_bytes,
        kv_cache_bytes_per_token=131072, has_tokenizer=True, has_chat_template=True)


@pytest.fixture
def chat():
    model = RegisteredModel.objects.create(name="llama-8b", task="generate")
    v1 = version(model, 1)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=2, resources=H100)
    replicas = [Replica.objects.create(deployment=deployment, version=v1, node="test", url=f"http://127.0.0.1:9/{i}",
                                       state=ReplicaState.READY) for i in range(2)]
    return deployment, v1, replicas


def minute(replica, at, **fields) -> ReplicaMetricsMinute:
    return ReplicaMetricsMinute.objects.create(replica=replica, deployment=replica.deployment,
                                               version=replica.version, start=at, scrapes=4, **fields)


def gpu(util: float, used: float, total: float = 163116.0, devices: int = 2) -> dict:
    return {"gpu_devices": devices, "gpu_scrapes": 4, "gpu_minutes": 1, "gpu_util_avg": util, "gpu_util_max": util,
            "gpu_memory_used_avg": used, "gpu_memory_total": total}


# --- series ----------------------------------------------------------------------------------


def test_gpu_series_count_only_rows_with_telemetry(chat):
    deployment, _, (first, second) = chat
    minute(first, T0, **gpu(80.0, 90000.0))
    minute(second, T0, **gpu(20.0, 30000.0, devices=1, total=81558.0))
    minute(first, T0 + timedelta(minutes=1))  # scraped, but no GPU series: unknown, not idle
    minute(first, T0 + timedelta(minutes=2), **gpu(50.0, 60000.0))
    end = T0 + timedelta(minutes=3)
    assert [value for _, value in deployment_series(deployment, "gpu_utilization", T0, end, 60)] == [
        pytest.approx((80 * 2 + 20 * 1) / 3 / 100), None, pytest.approx(0.5)]  # the mean over the 3 GPUs
    assert [value for _, value in deployment_series(deployment, "gpu_memory_used", T0, end, 60)] == [
        120000.0, None, 60000.0]
    assert [value for _, value in deployment_series(deployment, "gpu_memory_total", T0, end, 60)] == [
        163116.0 + 81558.0, None, 163116.0]


def test_gpu_series_through_the_api(api, chat):
    deployment, _, (first, _) = chat
    minute(first, T0, **gpu(40.0, 1000.0))
    body = api("viewer").get("/api/v1/deployments/chat/metrics/", {
        "series": "gpu_utilization", "start": T0.isoformat(), "end": (T0 + timedelta(minutes=1)).isoformat(),
        "step": "60"}).json()
    assert body == {"series": "gpu_utilization", "unit": "fraction", "points": [[T0.isoformat(), 0.4]]}


# --- model FLOPs utilisation -----------------------------------------------------------------


def test_the_peak_table_and_the_parameter_count():
    assert peak_flops("H100") == 989e12 and peak_flops("nvidia-l40s") == 362e12 and peak_flops("a10g") == 70e12
    assert peak_flops("nvidia-b200") is None
    assert set(PEAK_DENSE_BF16_TFLOPS) <= set(GPU_MEMORY_BYTES)  # every type with a peak is one inferops knows
    model = RegisteredModel.objects.create(name="m", task="generate")
    assert parameters(version(model, 1)) == (LLAMA_8B, "the registry's parameter count")
    # Without a count, from the weights' bytes and the dtype's bytes per parameter.
    assert parameters(version(model, 2, parameter_count=0)) == (
        LLAMA_8B, "weight bytes / 2 bytes per bfloat16 parameter")
    count, why = parameters(version(model, 3, parameter_count=0, dtype="mystery"))
    assert count is None and "neither a parameter count nor weight bytes of a known dtype" in why


def test_mfu_over_a_window_with_every_figure_of_its_formula(chat):
    deployment, _, (first, second) = chat
    for offset in range(10):  # both replicas, every minute: 1,200 prompt + generated tokens/s between them
        minute(first, T0 + timedelta(minutes=offset), prompt_tokens=30000, generation_tokens=6000)
        minute(second, T0 + timedelta(minutes=offset), prompt_tokens=30000, generation_tokens=6000)
    end = T0 + timedelta(minutes=10)
    summary = mfu_summary(deployment, T0, end)
    expected = 1200 * 2 * LLAMA_8B / (989e12 * 4)  # 2 replicas x 2 H100s
    assert summary["mfu"] == pytest.approx(expected)
    assert (summary["tokens_per_s"], summary["flops_per_token"], summary["peak_tflops"], summary["gpus"]) == (
        1200.0, 2.0 * LLAMA_8B, 989.0, 4.0)
    assert (summary["parameters"], summary["parameters_from"]) == (LLAMA_8B, "the registry's parameter count")
    assert "2 × parameters" in summary["note"]
    # The same estimate per step, for the chart.
    assert [value for _, value in deployment_series(deployment, "mfu", T0, end, 300)] == [
        pytest.approx(expected), pytest.approx(expected)]


@pytest.mark.parametrize(("resources", "reason"), [
    ({}, "the deployment holds no GPUs (resources.gpu_count is 0)"),
    ({"gpu_count": 1}, "resources.gpu_type is not set, so the GPUs' peak FLOPs are unknown"),
    ({"gpu_type": "nvidia-b200", "gpu_count": 8},
     "no peak FLOPs are known for GPU type 'nvidia-b200' (not a type inferops knows): see deployments/gpus.py"),
])
def test_mfu_is_not_shown_without_gpus_a_known_gpu_type(chat, resources, reason):
    deployment, _, (first, _) = chat
    deployment.resources = resources
    minute(first, T0, prompt_tokens=100)
    assert mfu_facts(deployment).reason == reason
    assert mfu_summary(deployment, T0, T0 + timedelta(minutes=1)) == {"reason": reason}
    assert deployment_series(deployment, "mfu", T0, T0 + timedelta(minutes=1), 60) == [[T0.isoformat(), None]]


def test_mfu_is_not_shown_without_a_parameter_count(chat):
    deployment, v1, _ = chat
    v1.parameter_count, v1.dtype = 0, "mystery"
    v1.save()
    assert mfu_facts(deployment).reason.startswith("the parameter count is unknown: llama-8b v1 records neither")
    v1.dtype = "bfloat16"  # then it is derived from the weights
    v1.save()
    assert mfu_facts(deployment).parameters == {v1.pk: (LLAMA_8B, "weight bytes / 2 bytes per bfloat16 parameter")}


# --- the page --------------------------------------------------------------------------------


def test_the_page_charts_gpu_utilisation_and_memory_beside_kv_cache_usage(client, make_user, chat):
    deployment, _, (first, _) = chat
    now = timezone.now().replace(second=0, microsecond=0)
    for offset in range(1, 6):
        minute(first, now - timedelta(minutes=offset), prompt_tokens=30000, generation_tokens=6000, **gpu(75.0, 9e4))
    client.force_login(make_user("viewer"))
    html = client.get("/deployments/chat/").content.decode()
    kv, util, memory = (html.index(f'id="chart-{key}"') for key in ("kv_cache_usage", "gpu_utilization", "gpu_memory"))
    assert kv < util < memory
    assert 'gpu_memory: ["gpu_memory_used", "gpu_memory_total"]' in html
    assert 'id="no-gpu-telemetry"' not in html
    # MFU over the hour the page shows: 5 minutes of 36,000 tokens on one replica of 2 H100s.
    summary = mfu_summary(deployment, timezone.now() - timedelta(hours=1), timezone.now())
    assert 'id="chart-mfu"' in html and 'id="mfu-formula"' in html
    assert "MFU = (prompt + generated tokens/s × FLOPs per token) / (peak FLOP/s per GPU × GPUs)" in html
    assert f'id="mfu-value">{summary["mfu"] * 100:.2f} %<' in html
    assert "16.06 GFLOPs" in html and "989 TFLOP/s (nvidia-h100, dense BF16)" in html
    assert "FLOPs per token ≈ 2 × parameters" in html
    assert "Parameters: 8.03 billion, from the registry&#x27;s parameter count." in html


def test_a_deployment_without_gpu_telemetry_says_so_in_one_line(client, make_user, chat):
    deployment, _, (first, _) = chat
    minute(first, timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=1), prompt_tokens=10)
    client.force_login(make_user("viewer"))
    html = client.get("/deployments/chat/").content.decode()
    assert 'id="chart-gpu_utilization"' not in html and 'id="chart-gpu_memory"' not in html
    assert "No GPU telemetry: no replica of it reported GPU series in the last 7 days." in html
    deployment.resources = {}
    deployment.save()
    html = client.get("/deployments/chat/?range=6h").content.decode()
    assert "No GPU telemetry: the deployment holds no GPUs." in html
    assert "Model FLOPs utilisation is not shown: the deployment holds no GPUs (resources.gpu_count is 0)." in html
    assert '<option value="6h" selected>last 6 hours</option>' in html
