"""Through `inferops gateway` (a real process, started by the CLI) to a real `inferops serve` of the
tiny checkpoint, with the official openai client: the usage event carries the replica's counts."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import free_port
from tests.gateway.conftest import REDIS_URL
from tests.services import Process

pytestmark = pytest.mark.timeout(180)


def test_openai_client_through_the_gateway_to_a_real_replica(tiny_llama_dir, control, tmp_path):
    replica_port, gateway_port = free_port(), free_port()
    replica = Process(["serve", "--model", str(tiny_llama_dir), "--port", str(replica_port),
                       "--served-model-name", "tiny-chat", "--max-model-len", "256", "--cpu-threads", "1",
                       "--log-level", "warning"], tmp_path / "replica.log",
                      f"http://127.0.0.1:{replica_port}/health")
    gateway = Process(["gateway", "--port", str(gateway_port), "--redis-url", REDIS_URL, "--instance", "e2e",
                       "--spool-dir", str(tmp_path / "spool"), "--log-level", "warning"], tmp_path / "gateway.log",
                      f"http://127.0.0.1:{gateway_port}/health")
    try:
        control.publish_route("tiny-chat", [(1, 100, [(7, f"http://127.0.0.1:{replica_port}")])])
        secret, prefix = control.publish_key("acme", ["tiny-chat"], tenant_limits={"rpm": 100, "tpm": 100_000})
        gateway.wait_healthy(30)
        replica.wait_healthy()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=secret, max_retries=0,
                               timeout=60)
        messages = [{"role": "user", "content": "Say something."}]
        exact = {"ignore_eos": True}  # random weights may sample EOS early; counts must be exact

        answer = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5,
                                                extra_body=exact)
        assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"

        chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6,
                                                     stream=True, extra_body=exact))
        assert all(c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)

        with_usage = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6,
                                                         stream=True, stream_options={"include_usage": True},
                                                         extra_body=exact))
        assert with_usage[-1].usage.completion_tokens == 6
        assert text

        events = control.wait_events(3)
        assert [(e["endpoint"], e["stream"], e["status"], e["completion_tokens"], e["replica"], e["key_prefix"])
                for e in events] == [("chat", False, 200, 5, 7, prefix), ("chat", True, 200, 6, 7, prefix),
                                     ("chat", True, 200, 6, 7, prefix)]
        assert events[0]["prompt_tokens"] == answer.usage.prompt_tokens == events[1]["prompt_tokens"] > 0
        assert events[1]["ttft_ms"] > 0 and events[1]["tpot_ms"] > 0 and events[1]["ttft_source"] == "gateway"
        # Non-streamed: the proxy cannot see the first token; the replica's Server-Timing header says when it was.
        assert events[0]["ttft_source"] == "server" and 0 < events[0]["ttft_ms"] <= events[0]["e2e_ms"]
        assert events[0]["tpot_ms"] > 0 and events[0]["finish_reason"] == "length"
    finally:
        gateway.stop()
        replica.stop()
