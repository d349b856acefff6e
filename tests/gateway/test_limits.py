"""The rate-limit scripts against a real Redis: charges, refunds, leases of concurrency slots."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from runtime.gateway.limits import Admission, RateLimiter, Refusal
from runtime.gateway.state import ApiKey
from tests.gateway.conftest import REDIS_URL


def _key(tenant: str, key_limits: dict | None = None, tenant_limits: dict | None = None) -> ApiKey:
    return ApiKey.from_json({"prefix": f"k-{tenant}", "tenant": tenant, "deployments": [],
                             "limits": {"key": key_limits, "tenant": tenant_limits}})


def _run(scenario) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            await scenario(client)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_tokens_are_charged_on_admission_and_reconciled_on_release(control):
    async def scenario(client):
        limiter = RateLimiter(client)
        key = _key("t-tpm", tenant_limits={"tpm": 100})
        first = await limiter.admit(key, "r1", 60)
        assert isinstance(first, Admission)
        # 60 charged: another 60 would pass 100.
        refused = await limiter.admit(key, "r2", 60)
        assert isinstance(refused, Refusal) and refused.message == "tenant t-tpm tpm limit 100 exceeded"
        assert 1 <= refused.retry_after_s <= 60
        await limiter.release(first, used_tokens=30)  # the real prompt + completion was smaller
        assert isinstance(await limiter.admit(key, "r3", 60), Admission)  # 30 + 60 <= 100
        (name,) = [k async for k in client.scan_iter("inferops:rl:tenant:t-tpm:tpm:*")]
        assert int(await client.get(name)) == 90
        assert 60 <= await client.ttl(name) <= 120

    _run(scenario)


def test_a_refused_request_charges_nothing_in_any_scope(control):
    async def scenario(client):
        limiter = RateLimiter(client)
        key = _key("t-both", key_limits={"rpm": 5}, tenant_limits={"rpm": 1})
        assert isinstance(await limiter.admit(key, "r1", 1), Admission)
        refused = await limiter.admit(key, "r2", 1)
        assert (refused.scope, refused.limit_name, refused.limit) == ("tenant", "rpm", 1)
        (name,) = [k async for k in client.scan_iter("inferops:rl:key:k-t-both:rpm:*")]
        assert int(await client.get(name)) == 1  # the key's own counter did not move for r2

    _run(scenario)


def test_slots_of_a_crashed_gateway_expire_and_live_ones_are_renewed(control):
    async def scenario(client):
        crashed = RateLimiter(client, lease_s=0.5)
        alive = RateLimiter(client, lease_s=0.5)
        key = _key("t-conc", tenant_limits={"max_concurrent": 2})
        assert isinstance(await crashed.admit(key, "lost", 0), Admission)  # never released
        held = await alive.admit(key, "held", 0)
        assert isinstance(held, Admission)
        refused = await alive.admit(key, "third", 0)
        assert isinstance(refused, Refusal) and refused.message == "tenant t-conc max_concurrent limit 2 exceeded"
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            await alive.renew_leases()
            await asyncio.sleep(0.1)
        # The lost slot's lease ran out; the renewed one is still held, so exactly one is free.
        assert isinstance(await alive.admit(key, "fourth", 0), Admission)
        assert isinstance(await alive.admit(key, "fifth", 0), Refusal)
        await alive.release(held, 0)
        assert await client.zrange("inferops:rl:tenant:t-conc:conc", 0, -1) == [b"fourth"]

    _run(scenario)


def test_spooled_events_replay_in_order_and_a_torn_line_is_skipped(control, tmp_path):
    from runtime.gateway.state import RedisHealth
    from runtime.gateway.usage import USAGE_STREAM, UsageSink

    spool = tmp_path / "gw.jsonl"
    # Left by an earlier run of this gateway that was killed in the middle of a write.
    spool.write_text('{"request_id": "gw-old-1"}\n{"request_id": "gw-old-2"}\n{"request_id": "gw-to')

    async def scenario(client):
        depths = []
        sink = UsageSink(client, spool, RedisHealth(), on_spool_depth=depths.append)
        assert sink.spool_depth == 3
        await sink.start()
        sink.emit({"request_id": "gw-new"})
        await sink.stop()
        assert depths[-1] == 0 and spool.read_text() == ""

    _run(scenario)
    ids = [e["request_id"] for e in control.events()]
    assert ids == ["gw-old-1", "gw-old-2", "gw-new"]
    assert control.redis.xlen(USAGE_STREAM) == 3


def test_a_full_spool_disk_keeps_events_in_memory_in_order_until_redis_takes_them(control, tmp_path):
    """Chaos suite, spool_disk_full: the writer task died on the first ENOSPC and every later event was lost.
    /dev/full answers every write with ENOSPC, as a full disk does."""
    from runtime.gateway.state import RedisHealth
    from runtime.gateway.usage import UsageSink

    spool = tmp_path / "gw.jsonl"

    async def scenario(client):
        health = RedisHealth(retry_s=0)
        sink = UsageSink(client, spool, health)
        spool.symlink_to("/dev/full")
        await sink.start()
        health.mark_down(ConnectionError("redis stopped"))
        health.worth_trying = lambda: health.up  # Redis stays "down" until the test says so
        for index in range(3):
            sink.emit({"request_id": f"held-{index}"})
            await sink.flush()
        assert sink.held_since_error and sink.spool_depth == 0
        health.mark_up()
        sink.emit({"request_id": "after"})
        await sink.stop()

    _run(scenario)
    assert [e["request_id"] for e in control.events()] == ["held-0", "held-1", "held-2", "after"]
