"""The gateway against fake replicas (stand-ins to test the proxy alone) and a real Redis."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.gateway.router import _rendezvous_score, affinity_key
from runtime.gateway.state import Replica
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

# One client for the whole module: building an httpx client (its TLS context) costs more than
# a request to the gateway, and tests time some of those requests.
HTTP = httpx.Client(timeout=20)


def _auth(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def _chat(content: str = "hi", **extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _client(base_url: str, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=secret, max_retries=0, timeout=20)


def _scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = HTTP.get(base_url.removesuffix("/v1") + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def demo(control, replicas, gateways):
    """One deployment `demo` on one fake replica, one unlimited key scoped to it, one gateway."""
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_route("other", [(1, 100, [(replica.id, replica.url)])])
    secret, prefix = control.publish_key("acme", ["demo"])
    gateway, base_url = gateways()
    return replica, secret, prefix, gateway, base_url


def test_auth_scope_and_unknown_deployment_errors_are_openai_shaped(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_route("other", [(1, 100, [(replica.id, replica.url)])])
    secret, prefix = control.publish_key("acme", ["demo"])
    expired, _ = control.publish_key("acme", expires_at=time.time() - 1)
    _, base_url = gateways()
    cases = [({}, 401, "Missing API key"), (_auth("iop_nope_nope"), 401, "Invalid API key"),
             (_auth(expired), 401, "has expired"),
             (_auth(secret), 403, "may not use the deployment `other`"),
             (_auth(secret), 404, "`ghost` does not exist")]
    for headers, status, message in cases:
        model = {403: "other", 404: "ghost"}.get(status, "demo")
        response = HTTP.post(f"{base_url}/chat/completions", json=_chat(model=model), headers=headers)
        assert response.status_code == status
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == status and set(error) == {
            "message", "type", "param", "code"}
    assert HTTP.post(f"{base_url}/chat/completions", content=b"{nope", headers=_auth(secret)).status_code == 400
    assert replica.bodies == []
    events = control.wait_events(len(cases) + 1)
    kinds = [(e["status"], e["error_kind"]) for e in events]
    assert kinds == [(401, "auth"), (401, "auth"), (401, "auth"), (403, "forbidden"), (404, "not_found"),
                     (400, "bad_request")]
    forbidden = events[-3]
    assert (forbidden["tenant"], forbidden["key_prefix"], forbidden["deployment"]) == ("acme", prefix, "other")
    # The openai client raises its own typed errors on these answers.
    with pytest.raises(openai.AuthenticationError):
        _client(base_url, "bad").chat.completions.create(**_chat())
    with pytest.raises(openai.NotFoundError):
        _client(base_url, secret).chat.completions.create(**_chat(model="ghost"))
    # /v1/models lists what this key may use.
    assert [m.id for m in _client(base_url, secret).models.list().data] == ["demo"]


def test_streaming_passes_chunks_through_and_the_usage_event_is_complete(demo, control):
    replica, secret, prefix, _, base_url = demo
    replica.behaviour.first_delay_s = 0.2
    replica.behaviour.chunk_delay_s = 0.05
    client = _client(base_url, secret)
    stream = client.chat.completions.create(**_chat("hello there"), stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage: stripped
    assert replica.bodies[-1]["stream_options"] == {"include_usage": True}  # but the gateway asked
    (event,) = control.wait_events(1)
    assert event["request_id"].startswith("gw-") and len(event["request_id"]) == 35
    assert {k: event[k] for k in ("tenant", "key_prefix", "deployment", "version", "replica", "priority",
                                  "endpoint", "stream", "prompt_tokens", "completion_tokens", "status",
                                  "finish_reason", "error_kind", "retries")} == {
        "tenant": "acme", "key_prefix": prefix, "deployment": "demo", "version": 1, "replica": replica.id,
        "priority": 1, "endpoint": "chat", "stream": True, "prompt_tokens": 7, "completion_tokens": 4,
        "status": 200, "finish_reason": "length", "error_kind": None, "retries": 0}
    assert 200 <= event["ttft_ms"] < 5000
    assert event["e2e_ms"] >= event["ttft_ms"] + 3 * 50
    assert event["tpot_ms"] == pytest.approx((event["e2e_ms"] - event["ttft_ms"]) / 3)
    assert abs(event["time"] - time.time()) < 5

    # Asked for usage: the client gets the usage chunk.
    chunks = list(client.chat.completions.create(**_chat(), stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4


def test_a_request_runs_at_its_keys_priority_and_a_client_may_only_lower_it(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_route("big", [(1, 100, [(replica.id, replica.url)])], backend="vllm")
    secret, _ = control.publish_key("acme", ["demo", "big"], priority=5)
    _, base_url = gateways()

    def sent(**body) -> dict:
        response = HTTP.post(f"{base_url}/chat/completions", json=_chat(**body), headers=_auth(secret))
        assert response.status_code == 200, response.text
        return replica.bodies[-1]

    assert sent()["priority"] == 5  # the key's, though the client said nothing
    assert sent(priority=1000)["priority"] == 5  # never above the key's
    assert sent(priority=-3)["priority"] == -3  # lower is the client's to choose
    # vLLM schedules first come first served (and orders priorities the other way): no field at all.
    assert "priority" not in sent(model="big", priority=1000)
    HTTP.post(f"{base_url}/embeddings", json={"model": "demo", "input": "abc", "priority": 9}, headers=_auth(secret))
    assert "priority" not in replica.bodies[-1]
    count = len(replica.bodies)
    refused = HTTP.post(f"{base_url}/chat/completions", json=_chat(priority="high"), headers=_auth(secret))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "at most your key's priority (5)" in refused.json()["error"]["message"]
    assert len(replica.bodies) == count  # refused before any replica
    events = control.wait_events(6)
    assert [e["priority"] for e in events[:4]] == [5, 5, -3, 5]


def test_chunks_reach_the_client_as_they_are_produced(demo):
    replica, secret, _, _, base_url = demo
    replica.behaviour.chunk_delay_s = 0.3
    arrivals = []
    with HTTP.stream("POST", f"{base_url}/chat/completions", json=_chat(stream=True), headers=_auth(secret)) as r:
        for _ in r.iter_raw():
            arrivals.append(time.monotonic())
    # Four content chunks 0.3 s apart arrive spread out, not in one buffered lump at the end.
    assert arrivals[-1] - arrivals[0] >= 0.8
    assert len(arrivals) >= 4


def test_non_streamed_completions_and_embeddings_carry_usage(demo, control):
    replica, secret, _, _, base_url = demo
    client = _client(base_url, secret)
    completion = client.completions.create(model="demo", prompt="a" * 40, max_tokens=4)
    assert completion.choices[0].text == "Hello world" and completion.usage.completion_tokens == 4
    embedding = client.embeddings.create(model="demo", input="abc")
    assert embedding.data[0].embedding == [0.5]
    first, second = control.wait_events(2)
    assert (first["endpoint"], first["stream"], first["prompt_tokens"], first["ttft_ms"]) == (
        "completions", False, 7, None)
    assert (second["endpoint"], second["prompt_tokens"], second["completion_tokens"]) == ("embeddings", 3, 0)


def test_rate_limits_answer_429_with_retry_after_and_name_the_limit(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    rpm_key, rpm_prefix = control.publish_key("rpm-tenant", key_limits={"rpm": 2})
    tpm_key, _ = control.publish_key("tpm-tenant", tenant_limits={"tpm": 100})
    _, base_url = gateways()
    statuses = [HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(rpm_key)) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    refused = statuses[-1]
    assert refused.json()["error"]["message"] == f"key {rpm_prefix} rpm limit 2 exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    with pytest.raises(openai.RateLimitError):
        _client(base_url, rpm_key).chat.completions.create(**_chat())

    # TPM: 400 prompt characters are charged as 100 tokens on admission; a second such prompt
    # would exceed the tenant's 100 (the first one's real usage, 7 + 4, is reconciled after).
    big = _chat("x" * 400)
    assert HTTP.post(f"{base_url}/chat/completions", json=big, headers=_auth(tpm_key)).status_code == 200
    wait_until(lambda: int(control.redis.get(_tpm_key(control, "tpm-tenant")) or 0) == 11,
               "the replica's token count charged to the tenant", timeout=5)
    second = HTTP.post(f"{base_url}/chat/completions", json=big, headers=_auth(tpm_key))
    assert second.status_code == 429 and second.json()["error"]["message"] == "tenant tpm-tenant tpm limit 100 exceeded"
    assert HTTP.post(f"{base_url}/chat/completions", json=_chat("x" * 40), headers=_auth(tpm_key)).status_code == 200
    events = control.wait_events(7)
    assert len(events) == 7 and [e["error_kind"] for e in events].count("rate_limited") == 3
    assert all(e["prompt_tokens"] == 0 for e in events if e["status"] == 429)
    metrics = _scrape(base_url)
    assert metrics[("inferops_gateway_rate_limited_total", (("limit", "rpm"), ("scope", "key")))] == 2
    assert metrics[("inferops_gateway_rate_limited_total", (("limit", "tpm"), ("scope", "tenant")))] == 1


def _tpm_key(control, tenant: str) -> str:
    (name,) = control.redis.keys(f"inferops:rl:tenant:{tenant}:tpm:*")
    return name


def _bypassed(started) -> float:
    """Requests the gateways admitted without limits: a Redis blip on a loaded machine makes a
    gateway fail open (the documented default, counted), and only those may go over a limit."""
    return sum(gateway.metrics.registry.get_sample_value("inferops_gateway_limits_bypassed_total")
               for gateway, _ in started)


def test_two_gateways_sharing_a_concurrency_limit_never_exceed_it(control, replicas, gateways):
    (replica,) = replicas(1)
    replica.behaviour.first_delay_s = 0.4
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, _ = control.publish_key("shared", tenant_limits={"max_concurrent": 3})
    started = [gateways(), gateways()]
    urls = [url for _, url in started]

    def call(i: int) -> int:
        return HTTP.post(f"{urls[i % 2]}/chat/completions", json=_chat(str(i)), headers=_auth(secret),
                          timeout=10).status_code

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(call, range(12)))
    assert replica.max_in_flight <= 3 + _bypassed(started)
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1 and set(statuses) == {200, 429}
    # Every slot came back: a new wave is admitted again.
    wait_until(lambda: control.redis.zcard("inferops:rl:tenant:shared:conc") == 0, "every concurrency slot back",
               timeout=5)
    assert call(0) == 200


def test_two_gateways_sharing_an_rpm_limit_admit_exactly_the_limit(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, _ = control.publish_key("rpm-shared", tenant_limits={"rpm": 10})
    started = [gateways(), gateways()]
    urls = [url for _, url in started]
    # Fixed windows: start well inside one so the 30 requests cannot straddle two.
    wait_until(lambda: control.redis.time()[0] % 60 <= 50, "10 s clear of a window's end", timeout=15)

    def call(i: int) -> int:
        return HTTP.post(f"{urls[i % 2]}/chat/completions", json=_chat(str(i)), headers=_auth(secret),
                          timeout=10).status_code

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(call, range(30)))
    admitted = 10 + _bypassed(started)
    assert statuses.count(200) == admitted and statuses.count(429) == 30 - admitted
    assert len(replica.bodies) == admitted


def test_a_revoked_key_stops_within_5_seconds_even_without_the_pubsub_message(control, demo):
    _, secret, _, _, base_url = demo
    other, _ = control.publish_key("acme")
    for key, announce in ((secret, True), (other, False)):
        assert HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(key)).status_code == 200
        control.revoke(key, announce=announce)
        revoked_at = time.monotonic()
        wait_until(lambda key=key: HTTP.post(f"{base_url}/chat/completions", json=_chat(),
                                             headers=_auth(key)).status_code == 401,
                   "the revoked key refused", timeout=5)
        took = time.monotonic() - revoked_at
        # The pub/sub message acts at once; without it the 1 s generation poll still does.
        assert took < (1.0 if announce else 4.0)


def test_a_dead_replica_is_retried_before_the_first_byte_and_ejected(control, replicas, gateways):
    (replica,) = replicas(1)
    from tests.conftest import free_port

    dead = (99, f"http://127.0.0.1:{free_port()}")
    control.publish_route("demo", [(1, 100, [dead, (replica.id, replica.url)])])
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    client = _client(base_url, secret)
    for i in range(10):
        stream = i % 2 == 0
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                **_chat(f"prompt {i}"), stream=True)) == "Hello world"
        else:
            assert client.chat.completions.create(**_chat(f"prompt {i}")).choices[0].message.content == "Hello world"
    events = control.wait_events(10)
    assert all(e["status"] == 200 and e["replica"] == replica.id for e in events)
    retried = sum(e["retries"] for e in events)
    assert 1 <= retried <= 3  # three connection errors eject the dead replica
    metrics = _scrape(base_url)
    assert metrics[("inferops_gateway_replica_ejections_total", (("deployment", "demo"),))] == 1
    assert metrics[("inferops_gateway_retries_total", (("deployment", "demo"),))] == retried
    assert metrics[("inferops_gateway_upstream_ejected", (("replica", dead[1]),))] == 1
    assert metrics[("inferops_gateway_upstream_outstanding", (("replica", replica.url),))] == 0
    assert metrics[("inferops_gateway_upstream_errors_total",
                    (("deployment", "demo"), ("kind", "upstream_connect")))] == retried


def test_a_5xx_before_the_first_byte_is_retried_on_another_replica(control, replicas, gateways):
    failing, healthy = replicas(2)
    failing.behaviour.fail_status = 500
    control.publish_route("demo", [(1, 100, [(failing.id, failing.url), (healthy.id, healthy.url)])])
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    prompt = _prompt_preferring(failing, [failing, healthy])
    response = HTTP.post(f"{base_url}/chat/completions", json=_chat(prompt, stream=True), headers=_auth(secret))
    assert response.status_code == 200 and b"[DONE]" in response.content
    (event,) = control.wait_events(1)
    assert (event["retries"], event["replica"], len(failing.bodies), len(healthy.bodies)) == (1, healthy.id, 1, 1)


def _prompt_preferring(target, candidates) -> str:
    """A prompt whose prefix-affinity choice is `target` (so the test knows where it goes first)."""
    for i in range(1000):
        prompt = f"prompt {i}"
        key = affinity_key(_chat(prompt))
        ranked = max(candidates, key=lambda r: _rendezvous_score(key, Replica(r.id, r.url)))
        if ranked is target:
            return prompt
    raise AssertionError("no prompt prefers the target")


def test_no_retry_once_streaming_started(control, replicas, gateways):
    breaking, healthy = replicas(2)
    breaking.behaviour.break_after_chunks = 2
    control.publish_route("demo", [(1, 100, [(breaking.id, breaking.url), (healthy.id, healthy.url)])])
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    prompt = _prompt_preferring(breaking, [breaking, healthy])
    received = b""
    with HTTP.stream("POST", f"{base_url}/chat/completions", json=_chat(prompt, stream=True),
                     headers=_auth(secret)) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            received += chunk
    assert b'"Hel"' in received and b'"lo"' in received and b"[DONE]" not in received
    assert received.endswith(b"\n\n") and b'data: {"error":' in received.rsplit(b"\n\n", 2)[-2]
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        list(_client(base_url, secret).chat.completions.create(**_chat(prompt), stream=True))
    events = control.wait_events(2)
    assert [(e["status"], e["error_kind"], e["retries"], e["replica"]) for e in events] == [
        (200, "upstream_error", 0, breaking.id)] * 2
    assert (len(breaking.bodies), len(healthy.bodies)) == (2, 0)


def test_saturated_replicas_shed_with_503_at_once(control, replicas, gateways):
    (replica,) = replicas(1)
    replica.behaviour.first_delay_s = 2.0
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_route("empty", [(1, 100, [])])
    secret, prefix = control.publish_key("acme", key_limits={"rpm": 100})
    _, base_url = gateways(max_outstanding_per_replica=2)

    def call(i: int) -> tuple[int, float, str | None]:
        start = time.monotonic()
        response = HTTP.post(f"{base_url}/chat/completions", json=_chat(str(i)), headers=_auth(secret), timeout=10)
        return response.status_code, time.monotonic() - start, response.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        results = list(pool.map(call, range(5)))
    assert sorted(status for status, _, _ in results) == [200, 200, 503, 503, 503]
    # Answered at once, not after queueing behind the 2 s requests.
    assert all(took < 1.0 and retry == "1" for status, took, retry in results if status == 503)
    empty = HTTP.post(f"{base_url}/chat/completions", json=_chat(model="empty"), headers=_auth(secret))
    assert empty.status_code == 503 and "No ready replica" in empty.json()["error"]["message"]
    assert [e["error_kind"] for e in control.wait_events(6)].count("shed") == 4
    # Shed requests were never admitted: only the two served ones count against the key's RPM.
    (rpm_counter,) = control.redis.keys(f"inferops:rl:key:{prefix}:rpm:*")
    assert int(control.redis.get(rpm_counter)) == 2


def test_a_client_that_disconnects_cancels_the_upstream_and_frees_its_slot(control, replicas, gateways):
    (replica,) = replicas(1)
    replica.behaviour.chunks = ["tok"] * 100
    replica.behaviour.chunk_delay_s = 0.05
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, prefix = control.publish_key("acme", key_limits={"max_concurrent": 1})
    _, base_url = gateways()
    with HTTP.stream("POST", f"{base_url}/chat/completions", json=_chat(stream=True), headers=_auth(secret)) as r:
        iterator = r.iter_raw()
        next(iterator)
        next(iterator)
    wait_until(lambda: replica.cancelled == 1, "the replica to see the cancel", timeout=3)
    assert replica.completed == 0
    (event,) = control.wait_events(1)
    assert (event["status"], event["error_kind"]) == (200, "client_disconnect")
    assert 1 <= event["completion_tokens"] < 100
    wait_until(lambda: control.redis.zcard(f"inferops:rl:key:{prefix}:conc") == 0, "the key's slot back",
               timeout=3)

    # Gone while waiting for the first token: no answer was sent, 499 in the ledger.
    replica.behaviour.first_delay_s = 5
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{base_url}/chat/completions", json=_chat(stream=True), headers=_auth(secret), timeout=0.5)
    wait_until(lambda: replica.cancelled == 2, "the replica to see the second cancel", timeout=3)
    assert control.wait_events(2)[-1]["status"] == 499

    # The same for a whole (non-streamed) answer.
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth(secret), timeout=0.5)
    wait_until(lambda: len(control.events()) == 3, "the third usage event", timeout=3)
    assert (control.events()[-1]["status"], control.events()[-1]["error_kind"]) == (499, "client_disconnect")
    wait_until(lambda: control.redis.zcard(f"inferops:rl:key:{prefix}:conc") == 0, "the key's slot back",
               timeout=3)


def test_metrics_exposition(demo, control):
    replica, secret, _, _, base_url = demo
    client = _client(base_url, secret)
    list(client.chat.completions.create(**_chat(), stream=True))
    HTTP.post(f"{base_url}/chat/completions", json=_chat(), headers=_auth("bad"))
    text = HTTP.get(base_url.removesuffix("/v1") + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("inferops_gateway_requests", "inferops_gateway_time_to_first_token_seconds",
                 "inferops_gateway_time_per_output_token_seconds", "inferops_gateway_e2e_request_latency_seconds",
                 "inferops_gateway_rate_limited", "inferops_gateway_upstream_errors", "inferops_gateway_retries",
                 "inferops_gateway_usage_spool_depth", "inferops_gateway_redis_up"):
        assert name in families, name
    samples = _scrape(base_url)
    assert samples[("inferops_gateway_requests_total", (("deployment", "demo"), ("status", "200")))] == 1
    assert samples[("inferops_gateway_requests_total", (("deployment", ""), ("status", "401")))] == 1
    assert samples[("inferops_gateway_time_to_first_token_seconds_count", (("deployment", "demo"),))] == 1
    assert samples[("inferops_gateway_redis_up", ())] == 1
    health = HTTP.get(base_url.removesuffix("/v1") + "/health").json()
    assert health == {"status": "ok", "redis": "up", "deployments": 2, "keys": 1, "usage_spool_depth": 0}


def test_a_replica_silent_past_the_first_token_timeout_is_a_504_and_the_next_one_gets_the_retry(
        control, replicas, gateways):
    slow, fast = replicas(2)
    slow.behaviour.first_delay_s = 3
    control.publish_route("demo", [(1, 100, [(slow.id, slow.url), (fast.id, fast.url)])])
    secret, _ = control.publish_key("acme")
    _, retrying = gateways(first_token_timeout_s=0.3)
    _, single = gateways(first_token_timeout_s=0.3, max_attempts=1)
    prompt = _prompt_preferring(slow, [slow, fast])
    response = HTTP.post(f"{retrying}/chat/completions", json=_chat(prompt, stream=True), headers=_auth(secret))
    assert response.status_code == 200 and b"[DONE]" in response.content
    response = HTTP.post(f"{single}/chat/completions", json=_chat(prompt, stream=True), headers=_auth(secret))
    assert response.status_code == 504
    assert response.json()["error"]["message"].startswith("Upstream request timed out: no answer from the replica")
    first, second = control.wait_events(2)
    assert (first["status"], first["retries"], first["replica"], first["error_kind"]) == (200, 1, fast.id, None)
    assert (second["status"], second["error_kind"], second["replica"]) == (504, "upstream_timeout", slow.id)
