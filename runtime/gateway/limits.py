"""Rate limits shared by every gateway instance: one Lua call admits a request, one releases it.

Windows are fixed 60 s windows on Redis's own clock (`TIME` inside the script), so instances
with skewed clocks still count into the same window. Per scope (the key, then its tenant):
- `<base>:rpm:<window>` counts requests, `<base>:tpm:<window>` counts tokens: the prompt
  estimate is charged on admission and corrected to prompt + completion tokens on release;
- `<base>:conc` is a sorted set of in-flight request ids scored by lease expiry. The gateway
  renews the leases of its live requests, so slots of a crashed gateway free themselves when
  their lease runs out instead of leaking forever.
Checks run for every scope before anything is charged, so a refused request costs nothing.
Key names are built inside the script from the bases passed in KEYS (one Redis, not Cluster).
An admission also returns each scope's counts after the charge and the time left in the window,
which become OpenAI's `x-ratelimit-*` response headers (`ratelimit_headers`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from runtime.gateway.contract import RATE_LIMIT_PREFIX
from runtime.gateway.state import ApiKey, ScopeLimits

logger = logging.getLogger(__name__)

WINDOW_S = 60

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = math.floor(now / 60)
local until_next_window = math.ceil((window + 1) * 60 - now)
local reset_ms = math.ceil(((window + 1) * 60 - now) * 1000)
local request_id, cost, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i, base in ipairs(KEYS) do
  local o = 3 + (i - 1) * 3
  local rpm, tpm, conc = tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
  if rpm >= 0 and tonumber(redis.call('GET', base .. ':rpm:' .. window) or '0') + 1 > rpm then
    return {i, 'rpm', rpm, until_next_window, reset_ms}
  end
  if tpm >= 0 and tonumber(redis.call('GET', base .. ':tpm:' .. window) or '0') + cost > tpm then
    return {i, 'tpm', tpm, until_next_window, reset_ms}
  end
  if conc >= 0 then
    redis.call('ZREMRANGEBYSCORE', base .. ':conc', '-inf', now)
    if redis.call('ZCARD', base .. ':conc') + 1 > conc then
      return {i, 'max_concurrent', conc, 1, 0}
    end
  end
end
local result = {0, '', 0, window, reset_ms}
for i, base in ipairs(KEYS) do
  local o = 3 + (i - 1) * 3
  local rpm, tpm, conc = tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
  local used_requests, used_tokens = -1, -1
  if rpm >= 0 then
    used_requests = redis.call('INCR', base .. ':rpm:' .. window)
    redis.call('EXPIRE', base .. ':rpm:' .. window, 120)
  end
  if tpm >= 0 then
    used_tokens = redis.call('INCRBY', base .. ':tpm:' .. window, cost)
    redis.call('EXPIRE', base .. ':tpm:' .. window, 120)
  end
  table.insert(result, used_requests)
  table.insert(result, used_tokens)
  if conc >= 0 then
    redis.call('ZADD', base .. ':conc', now + lease, request_id)
    redis.call('EXPIRE', base .. ':conc', math.ceil(lease) + 60)
  end
end
return result
"""

_RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = math.floor(now / 60)
local request_id, admitted_window, delta = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i, base in ipairs(KEYS) do
  local o = 3 + (i - 1) * 2
  if ARGV[o + 1] == '1' and delta ~= 0 then
    -- Refunds only make sense in the window that was charged; extra tokens count where they land.
    if window == admitted_window then
      redis.call('INCRBY', base .. ':tpm:' .. window, delta)
    elseif delta > 0 then
      redis.call('INCRBY', base .. ':tpm:' .. window, delta)
      redis.call('EXPIRE', base .. ':tpm:' .. window, 120)
    end
  end
  if ARGV[o + 2] == '1' then
    redis.call('ZREM', base .. ':conc', request_id)
  end
end
return 1
"""

_RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('ZADD', ARGV[i], 'XX', expiry, ARGV[i + 1])
end
return 1
"""


@dataclass(frozen=True)
class Refusal:
    scope: str  # "key" or "tenant"
    scope_name: str
    limit_name: str  # rpm, tpm or max_concurrent
    limit: int
    retry_after_s: int
    reset_ms: int = 0

    @property
    def message(self) -> str:
        return f"{self.scope} {self.scope_name} {self.limit_name} limit {self.limit} exceeded"

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The exhausted limit as OpenAI reports it (concurrency has no OpenAI header)."""
        unit = {"rpm": "requests", "tpm": "tokens"}.get(self.limit_name)
        return [] if unit is None else _headers(unit, self.limit, 0, self.reset_ms)


@dataclass
class Admission:
    """What one admitted request holds: released exactly once at the end."""

    request_id: str
    window: int
    charged_tokens: int
    scopes: list[tuple[str, ScopeLimits]]
    reset_ms: int = 0
    used: list[tuple[int, int]] = field(default_factory=list)  # per scope: (requests, tokens) this window

    @property
    def holds_slots(self) -> bool:
        return any(limits.max_concurrent is not None for _, limits in self.scopes)

    def ratelimit_headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's `x-ratelimit-*` headers for the requests and tokens limits; with both a key
        and a tenant limit, the scope with less left is the one reported."""
        headers: list[tuple[bytes, bytes]] = []
        for unit, index, limit_of in (("requests", 0, lambda lim: lim.rpm), ("tokens", 1, lambda lim: lim.tpm)):
            left = [(limit_of(limits) - used[index], limit_of(limits))
                    for (_, limits), used in zip(self.scopes, self.used, strict=True) if limit_of(limits) is not None]
            if left:
                remaining, limit = min(left)
                headers += _headers(unit, limit, max(0, remaining), self.reset_ms)
        return headers


def _headers(unit: str, limit: int, remaining: int, reset_ms: int) -> list[tuple[bytes, bytes]]:
    return [(f"x-ratelimit-limit-{unit}".encode(), str(limit).encode()),
            (f"x-ratelimit-remaining-{unit}".encode(), str(remaining).encode()),
            (f"x-ratelimit-reset-{unit}".encode(), openai_duration(reset_ms / 1000).encode())]


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers (Go's format, to the millisecond): `0s`,
    `20ms`, `1s`, `1.5s`, `6m0s`, `1h0m0s`."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    rest = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{rest}"
    return f"{minutes}m{rest}" if minutes else rest


def _scopes(key: ApiKey) -> list[tuple[str, str, ScopeLimits]]:
    return [("key", key.prefix, key.key_limits), ("tenant", key.tenant, key.tenant_limits)]


def _arg(value: int | None) -> int:
    return -1 if value is None else int(value)


class RateLimiter:
    def __init__(self, client: aioredis.Redis, lease_s: float = 60.0) -> None:
        self.client = client
        self.lease_s = lease_s
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self.live: dict[str, Admission] = {}  # requests holding concurrency slots, for renewal

    @staticmethod
    def needed(key: ApiKey) -> bool:
        return not (key.key_limits.unlimited and key.tenant_limits.unlimited)

    async def admit(self, key: ApiKey, request_id: str, prompt_tokens: int) -> Admission | Refusal:
        """Raises RedisError/OSError when Redis is unreachable; the caller applies the policy."""
        scopes = _scopes(key)
        bases = [f"{RATE_LIMIT_PREFIX}:{scope}:{name}" for scope, name, _ in scopes]
        args: list[int | str | float] = [request_id, prompt_tokens, self.lease_s]
        for _, _, limits in scopes:
            args += [_arg(limits.rpm), _arg(limits.tpm), _arg(limits.max_concurrent)]
        index, limit_name, limit, extra, reset_ms, *used = await self._admit(keys=bases, args=args)
        if index:
            scope, name, _ = scopes[index - 1]
            return Refusal(scope, name, limit_name.decode(), int(limit), max(1, int(extra)), int(reset_ms))
        limits_by_base = [(base, limits) for base, (_, _, limits) in zip(bases, scopes, strict=True)]
        admission = Admission(request_id, window=int(extra), charged_tokens=prompt_tokens, scopes=limits_by_base,
                              reset_ms=int(reset_ms),
                              used=[(int(used[i]), int(used[i + 1])) for i in range(0, len(used), 2)])
        if admission.holds_slots:
            self.live[request_id] = admission
        return admission

    async def release(self, admission: Admission, used_tokens: int) -> None:
        """Frees the slots and corrects the token charge; raises on Redis errors like `admit`."""
        self.live.pop(admission.request_id, None)
        args: list[int | str] = [admission.request_id, admission.window, used_tokens - admission.charged_tokens]
        for _, limits in admission.scopes:
            args += ["1" if limits.tpm is not None else "0", "1" if limits.max_concurrent is not None else "0"]
        await self._release(keys=[base for base, _ in admission.scopes], args=args)

    async def renew_leases(self) -> None:
        if not self.live:
            return
        args: list[str | float] = [self.lease_s]
        for admission in list(self.live.values()):
            for base, limits in admission.scopes:
                if limits.max_concurrent is not None:
                    args += [f"{base}:conc", admission.request_id]
        await self._renew(keys=[], args=args)


def estimate_prompt_tokens(body: dict) -> int:
    """Tokens charged on admission: characters / 4 rounded up, or the length of token-id lists."""
    if "messages" in body:
        return _estimate(body.get("messages"))
    return _estimate(body.get("prompt", body.get("input")))


def _estimate(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return math.ceil(len(value) / 4)
    if isinstance(value, list):
        if value and all(isinstance(item, int) for item in value):
            return len(value)
        return sum(_estimate(item) for item in value)
    if isinstance(value, dict):
        # A chat message or a content part: only the text counts.
        return _estimate(value.get("content")) + _estimate(value.get("text"))
    return 0
