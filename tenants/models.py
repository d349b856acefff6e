"""Tenants (who pays), their API keys (stored only as a hash) and the usage ledger.

The ledger has two tables: `UsageEvent`, one raw row per gateway request (unique by request id,
which is what makes ingestion idempotent), and `UsageMinute`, the per-minute roll-up by tenant,
key, deployment and version that costing, SLOs and the usage API read.
"""

from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import BrinIndex
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from inferops.models import Authored, Created
from inferops.validators import slug_validator

KEY_PREFIX_LENGTH = 8  # lowercase hex characters, shown to humans
KEY_SECRET_LENGTH = 40  # url-safe characters
PRIORITY_RANGE = (-1000, 1000)


def new_prefix() -> str:
    return secrets.token_hex(KEY_PREFIX_LENGTH // 2)


def new_key(prefix: str) -> str:
    # token_urlsafe(30) is 40 characters of [A-Za-z0-9_-]: 240 bits, shown once, never stored.
    return f"iop_{prefix}_{secrets.token_urlsafe(30)}"


class Limits(models.Model):
    """Requests per minute, tokens per minute and concurrent requests; null means unlimited."""

    rpm_limit = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    tpm_limit = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])

    class Meta:
        abstract = True

    def limits(self) -> dict:
        return {"rpm": self.rpm_limit, "tpm": self.tpm_limit, "max_concurrent": self.max_concurrent}


class Tenant(Limits, Authored):
    """A team or customer: the unit that pays and whose limits all its keys share."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    display_name = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKeyQuerySet(models.QuerySet):
    def active(self, now=None):
        now = now or timezone.now()
        unexpired = models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        return self.filter(unexpired, revoked_at__isnull=True)


class ApiKey(Limits, Created):
    """One API key of a tenant. The secret is shown once at creation; only its hash is kept."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=KEY_PREFIX_LENGTH, unique=True)
    key_hash = models.CharField(max_length=64, unique=True)
    # Deployment names this key may call; empty means every deployment.
    deployments = ArrayField(models.CharField(max_length=63, validators=[slug_validator]), default=list, blank=True)
    # Higher is more important; graceful degradation sheds the lowest priorities first.
    priority = models.IntegerField(
        default=0, validators=[MinValueValidator(PRIORITY_RANGE[0]), MaxValueValidator(PRIORITY_RANGE[1])]
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["tenant", "-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.tenant.name}/{self.prefix} {self.name}"

    @property
    def state(self) -> str:
        if self.revoked_at:
            return "revoked"
        if self.expires_at and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class UsageEvent(models.Model):
    """One gateway request, exactly as the gateway reported it (see the gateway contract).

    Text fields are NULL where the event's are null (a 401 has no tenant or key): NULL is "not
    known", which an empty string would blur, and the ledger keeps that distinction.
    """

    request_id = models.CharField(max_length=64)  # the gateway's own id: the ledger's idempotency key
    # The client's X-Request-Id, when it sent a usable one: what the client and the replica's logs know.
    client_request_id = models.CharField(max_length=128, null=True, blank=True)  # noqa: DJ001
    time = models.DateTimeField(help_text="When the request started.")
    tenant = models.CharField(max_length=63, null=True, blank=True)  # noqa: DJ001
    key_prefix = models.CharField(max_length=KEY_PREFIX_LENGTH, null=True, blank=True)  # noqa: DJ001
    deployment = models.CharField(max_length=63, null=True, blank=True)  # noqa: DJ001
    version = models.IntegerField(null=True, blank=True)
    replica = models.BigIntegerField(null=True, blank=True)
    # The first replica that failed this request before the gateway retried it elsewhere: a
    # candidate's errors must count against it even when the retry hid them from the client.
    failed_replica = models.BigIntegerField(null=True, blank=True)
    priority = models.IntegerField(default=0)
    endpoint = models.CharField(max_length=16)
    stream = models.BooleanField(default=False)
    prompt_tokens = models.IntegerField(default=0)
    completion_tokens = models.IntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    tpot_ms = models.FloatField(null=True, blank=True)
    # Who measured ttft_ms/tpot_ms: "gateway" (a stream, timed at the proxy) or "server" (the
    # replica's Server-Timing header on a whole answer); NULL when nobody did.
    ttft_source = models.CharField(max_length=16, null=True, blank=True)  # noqa: DJ001
    e2e_ms = models.FloatField()
    status = models.SmallIntegerField()
    finish_reason = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001
    error_kind = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001
    retries = models.SmallIntegerField(default=0)
    # Set on a line of an offline batch (/v1/batches): usage and cost, never a latency SLI.
    batch_id = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    ingested_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-time"]
        constraints = [
            # A constraint rather than unique=True: the field option also builds a second
            # (LIKE-pattern) index that every insert would pay for and no query uses.
            models.UniqueConstraint(fields=["request_id"], name="usage_event_request_id"),
        ]
        indexes = [
            models.Index(fields=["deployment", "time"]),
            models.Index(fields=["tenant", "time"]),
            # Retention pruning deletes by time alone. Rows arrive roughly in time order, so a BRIN
            # index serves it at almost no cost per insert (a third btree slowed ingestion).
            BrinIndex(fields=["time"], name="usage_event_time_brin"),
        ]

    def __str__(self) -> str:
        return self.request_id


class UsageMinute(models.Model):
    """Per-minute ledger row: tenant × key × deployment × version.

    `errors` counts server-side failures (status >= 500, or shed / upstream / internal errors);
    `client_errors` the 4xx the client caused and the 503s a degradation policy shed on purpose.
    Latency sums, counts and histograms cover requests that succeeded (status < 400); histograms
    map a bucket's upper bound in ms (see tenants.ingest.LATENCY_BUCKETS_MS) to a count, so
    percentiles of any period are exact to one fine bucket after summing rows.
    Lines of offline batches count in the requests, errors and tokens like any request, and again
    in the `batch_*` counters; they add nothing to the latency roll-ups, which stay interactive.
    """

    minute = models.DateTimeField()
    tenant = models.CharField(max_length=63, null=True, blank=True)  # noqa: DJ001
    key_prefix = models.CharField(max_length=KEY_PREFIX_LENGTH, null=True, blank=True)  # noqa: DJ001
    deployment = models.CharField(max_length=63, null=True, blank=True)  # noqa: DJ001
    version = models.IntegerField(null=True, blank=True)
    requests = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)
    client_errors = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    ttft_sum_ms = models.FloatField(default=0)
    ttft_count = models.BigIntegerField(default=0)
    tpot_sum_ms = models.FloatField(default=0)
    tpot_count = models.BigIntegerField(default=0)
    e2e_sum_ms = models.FloatField(default=0)
    e2e_count = models.BigIntegerField(default=0)
    ttft_buckets = models.JSONField(default=dict, blank=True)
    tpot_buckets = models.JSONField(default=dict, blank=True)
    e2e_buckets = models.JSONField(default=dict, blank=True)
    batch_requests = models.BigIntegerField(default=0, db_default=0)
    batch_errors = models.BigIntegerField(default=0, db_default=0)
    batch_prompt_tokens = models.BigIntegerField(default=0, db_default=0)
    batch_completion_tokens = models.BigIntegerField(default=0, db_default=0)

    class Meta:
        ordering = ["minute"]
        constraints = [
            # NULLS NOT DISTINCT: a 401 has no tenant or key, and its rows must still merge.
            models.UniqueConstraint(
                fields=["minute", "tenant", "key_prefix", "deployment", "version"],
                name="usage_minute_identity", nulls_distinct=False,
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "minute"]),
            models.Index(fields=["deployment", "minute"]),
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.tenant}/{self.key_prefix} {self.deployment} v{self.version}"
