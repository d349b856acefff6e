"""The cost ledger: prices, replica lifetimes, hourly cost and usage roll-ups, closed months, budgets.

Money is `Decimal` everywhere: prices have 6 decimal places, ledger amounts 10 (a minute of a
$0.05/h core is $0.000833...; rounding there would lose whole cents over a month). Reports
round once, at the end (costing/report.py).

Names, not foreign keys, identify deployments, versions and tenants in the ledger, as in the
usage ledger (tenants.UsageMinute): a deleted deployment's costs stay on the books.
"""

from __future__ import annotations

from decimal import Decimal

from django.contrib.postgres.fields import ArrayField
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from costing.choices import Tier
from inferops.models import Authored, Created

MONEY = {"max_digits": 18, "decimal_places": 6}
LEDGER_MONEY = {"max_digits": 24, "decimal_places": 10, "default": 0}


class Price(Created):
    """What one unit of a resource costs per hour from `effective_from` (until `effective_to`).

    `resource` is `cpu` (per core-hour), `memory` (per GiB-hour), `gpu:<gpu_type>` (per
    GPU-hour, matched to a deployment's resources.gpu_type) or `node:<name>` (a flat hourly
    price for the whole node, shared by the replicas on it).
    """

    resource = models.CharField(max_length=100)
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.ON_DEMAND)
    usd_per_hour = models.DecimalField(**MONEY)
    effective_from = models.DateTimeField()
    effective_to = models.DateTimeField(null=True, blank=True, help_text="Open-ended when empty.")
    note = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["resource", "tier", "effective_from"]
        indexes = [models.Index(fields=["resource", "tier", "effective_from"])]

    def __str__(self) -> str:
        return f"{self.resource} {self.tier} ${self.usd_per_hour}/h from {self.effective_from:%Y-%m-%d %H:%M}"


class ListPrice(Created):
    """What tenants are charged per million tokens of a deployment (showback / chargeback).

    An empty tenant is the deployment's list price; a row naming a tenant overrides it. Lines of
    offline batches pay the batch price: this price less `batch_discount_percent`.
    """

    deployment = models.CharField(max_length=63)
    tenant = models.CharField(max_length=63, blank=True)
    usd_per_mtok_prompt = models.DecimalField(**MONEY)
    usd_per_mtok_completion = models.DecimalField(**MONEY)
    # 50 by default, as OpenAI's Batch API is half price.
    batch_discount_percent = models.DecimalField(
        max_digits=5, decimal_places=2, default=Decimal(50), db_default=Decimal(50),
        validators=[MinValueValidator(0), MaxValueValidator(100)],
        help_text="The batch price is the list price less this percentage.")
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["deployment", "tenant", "effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "tenant", "effective_from"], name="one_list_price_per_start"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment}/{self.tenant or '*'} from {self.effective_from:%Y-%m-%d}"

    @property
    def batch_factor(self) -> Decimal:
        """What a batch token pays of the list price (0.5 at a 50 % discount)."""
        return (100 - self.batch_discount_percent) / 100

    def batch_prices(self) -> tuple[Decimal, Decimal]:
        """$ per million (prompt, completion) tokens of a batch line."""
        return (self.usd_per_mtok_prompt * self.batch_factor, self.usd_per_mtok_completion * self.batch_factor)


class ReplicaLife(models.Model):
    """One run of a replica's process, from start to exit, with what it held.

    A replica row is reused across restarts (its started_at is overwritten), so the ledger keeps
    its own record of each run, taken by the ledger task each minute. `ended_at` is null while
    the run goes on; `seen_until` is the last time the task saw it running.
    """

    replica = models.ForeignKey("deployments.Replica", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")
    replica_ref = models.BigIntegerField(help_text="The replica's id, kept when its row is gone.")
    deployment = models.CharField(max_length=63)
    version = models.IntegerField()
    model = models.CharField(max_length=63)
    driver = models.CharField(max_length=16)
    node = models.CharField(max_length=255)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    seen_until = models.DateTimeField()
    gpu_type = models.CharField(max_length=100, blank=True)
    gpu_count = models.PositiveIntegerField(default=0)
    cpus = models.DecimalField(max_digits=12, decimal_places=3, default=0)
    memory_gib = models.DecimalField(max_digits=16, decimal_places=4, default=0)
    resources_from = models.CharField(max_length=200, blank=True, help_text="How the resources were derived.")

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [models.UniqueConstraint(fields=["replica_ref", "started_at"], name="one_life_per_start")]
        indexes = [models.Index(fields=["ended_at"]), models.Index(fields=["node", "started_at"])]

    def __str__(self) -> str:
        return f"{self.deployment} v{self.version} replica {self.replica_ref} from {self.started_at:%Y-%m-%d %H:%M}"


class CostHour(models.Model):
    """The cost of one replica run in one hour, priced minute by minute."""

    life = models.ForeignKey(ReplicaLife, on_delete=models.CASCADE, related_name="hours")
    hour = models.DateTimeField()
    deployment = models.CharField(max_length=63)
    version = models.IntegerField()
    model = models.CharField(max_length=63)
    minutes = models.PositiveIntegerField(default=0)
    gpu_usd = models.DecimalField(**LEDGER_MONEY)
    cpu_usd = models.DecimalField(**LEDGER_MONEY)
    memory_usd = models.DecimalField(**LEDGER_MONEY)
    node_usd = models.DecimalField(**LEDGER_MONEY)
    usd = models.DecimalField(**LEDGER_MONEY)

    class Meta:
        ordering = ["hour", "life"]
        constraints = [models.UniqueConstraint(fields=["life", "hour"], name="one_cost_row_per_life_hour")]
        indexes = [models.Index(fields=["hour", "deployment"])]

    def __str__(self) -> str:
        return f"{self.deployment} life {self.life_id} @ {self.hour:%Y-%m-%d %H}: ${self.usd}"


class UsageHour(models.Model):
    """Tokens per hour × deployment × version × tenant from the usage ledger, with the tokens of
    requests that met every latency SLO of the deployment and those of offline batches' lines
    (both subsets of the prompt and completion tokens)."""

    hour = models.DateTimeField()
    deployment = models.CharField(max_length=63)
    version = models.IntegerField()
    tenant = models.CharField(max_length=63)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    compliant_prompt_tokens = models.BigIntegerField(default=0)
    compliant_completion_tokens = models.BigIntegerField(default=0)
    batch_prompt_tokens = models.BigIntegerField(default=0, db_default=0)
    batch_completion_tokens = models.BigIntegerField(default=0, db_default=0)
    # The usage pipeline added to the row since the ledger sync last looked (costing/usage.py).
    changed = models.BooleanField(default=False, db_default=False)

    class Meta:
        ordering = ["hour"]
        constraints = [
            models.UniqueConstraint(fields=["hour", "deployment", "version", "tenant"], name="one_usage_hour"),
        ]
        indexes = [models.Index(fields=["deployment", "hour"]),
                   models.Index(fields=["hour"], condition=models.Q(changed=True), name="usage_hour_changed")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H} {self.tenant} {self.deployment} v{self.version}"


class LedgerState(models.Model):
    """The ledger task's high-water marks (one row)."""

    cost_through = models.DateTimeField(null=True, blank=True, help_text="Cost rows are complete up to here.")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"ledger through {self.cost_through}"


class ClosedMonth(models.Model):
    """A month whose report is frozen: stored once at close, never recomputed."""

    month = models.DateField(unique=True, help_text="The first day of the month.")
    closed_at = models.DateTimeField()
    report = models.JSONField(help_text="The report as the API answered it at close.")
    cells = models.JSONField(help_text="Exact (unrounded) tenant × deployment × version figures at close.")

    class Meta:
        ordering = ["-month"]

    def __str__(self) -> str:
        return f"{self.month:%Y-%m} closed {self.closed_at:%Y-%m-%d %H:%M}"


class Adjustment(models.Model):
    """A change to a closed month's figures (late usage, a late-seen replica run), booked in the
    month that was open when it was found. An empty tenant is the idle line."""

    booked_month = models.DateField()
    source_month = models.DateField()
    tenant = models.CharField(max_length=63, blank=True)
    deployment = models.CharField(max_length=63)
    version = models.IntegerField()
    model = models.CharField(max_length=63)
    usd = models.DecimalField(**LEDGER_MONEY)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    compliant_tokens = models.BigIntegerField(default=0)
    batch_prompt_tokens = models.BigIntegerField(default=0, db_default=0)
    batch_completion_tokens = models.BigIntegerField(default=0, db_default=0)
    batch_usd = models.DecimalField(**LEDGER_MONEY, db_default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["booked_month", "source_month", "id"]
        indexes = [models.Index(fields=["booked_month"]), models.Index(fields=["source_month"])]

    def __str__(self) -> str:
        return f"{self.source_month:%Y-%m} -> {self.booked_month:%Y-%m}: {self.tenant or 'idle'} {self.deployment}"


class Budget(Authored):
    """A tenant's monthly budget (optionally for one deployment), with alert thresholds in percent."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="budgets")
    deployment = models.CharField(max_length=63, blank=True, help_text="Empty: all the tenant's deployments.")
    monthly_usd = models.DecimalField(max_digits=14, decimal_places=2,
                                      validators=[MinValueValidator(0)])
    thresholds = ArrayField(
        models.PositiveSmallIntegerField(validators=[MinValueValidator(1), MaxValueValidator(1000)]),
        default=list, size=10,
    )

    class Meta:
        ordering = ["tenant__name", "deployment"]
        constraints = [models.UniqueConstraint(fields=["tenant", "deployment"], name="one_budget_per_scope")]

    def __str__(self) -> str:
        scope = f"{self.tenant.name}/{self.deployment}" if self.deployment else self.tenant.name
        return f"{scope}: ${self.monthly_usd}/month"
