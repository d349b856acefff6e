"""Replicas (one serving process or pod each) and their scraped metrics, per minute and rolled up per hour."""


from django.db import models

from deployments.choices import (
    DriverName,
    ReplicaState,
)
from deployments.rollouts.models import Rollout
from registry.models import ModelVersion


class Replica(models.Model):
    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="replica_set")
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="replicas")
    driver = models.CharField(max_length=16, choices=DriverName.choices, default=DriverName.LOCAL)
    node = models.CharField(max_length=255, help_text="Host (local driver) or cluster/namespace.")
    url = models.CharField(max_length=255, blank=True, help_text="Base URL of its OpenAI API.")
    port = models.PositiveIntegerField(null=True, blank=True)
    # Process identity (pid + start time, so a recycled pid is never mistaken for ours) or pod name.
    identity = models.JSONField(default=dict, blank=True)
    engine_args = models.JSONField(default=dict, blank=True)
    # Set on replicas a rollout started as its candidate: analysis tells the tracks apart by it
    # (a candidate may differ only in engine args), and an abort drains exactly these.
    rollout = models.ForeignKey(Rollout, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="replicas")
    state = models.CharField(max_length=16, choices=ReplicaState.choices, default=ReplicaState.PENDING)
    restarts = models.PositiveIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    crash_looping = models.BooleanField(default=False)
    not_before = models.DateTimeField(null=True, blank=True, help_text="Backoff: do not start before.")
    log_path = models.CharField(max_length=1024, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    draining_since = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    last_health_ok = models.BooleanField(null=True)
    last_error = models.TextField(blank=True)
    # The previous scrape's raw counter and histogram values, for deltas and reset detection.
    scrape_state = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "runtime_replica"  # made by the runtime app, before the replica layer moved here
        ordering = ["deployment__name", "id"]
        indexes = [models.Index(fields=["deployment", "state"]), models.Index(fields=["node", "state"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.pk}"


class ReplicaStart(models.Model):
    """One start of a replica's process, with when each phase of its cold start ended.

    Phases: the control plane asks the driver for the process (`started_at`), the process is up
    (`process_started_at`, from the replica's own /metrics), its weights are loaded
    (`weights_loaded_at`), /health answers 200 (`ready_at`) and the first token leaves
    (`first_token_at`). A replica row is reused across restarts; each start gets its own row.
    """

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="starts")
    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="replica_starts")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="+")
    # Why it started: "scale" (a new replica), "restart" (replacing a failed one), "wake" (from zero,
    # for a request the gateway holds).
    cause = models.CharField(max_length=16, default="scale")
    started_at = models.DateTimeField()
    process_started_at = models.DateTimeField(null=True, blank=True)
    weights_loaded_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    failed = models.BooleanField(default=False)

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["deployment", "started_at"])]

    def __str__(self) -> str:
        return f"replica {self.replica_id} start @ {self.started_at:%Y-%m-%d %H:%M:%S}"

    def seconds(self) -> dict[str, float | None]:
        """Seconds from the start request to the end of each phase (None: not reached or unknown)."""
        return {phase: (moment - self.started_at).total_seconds() if moment else None
                for phase, moment in (("process", self.process_started_at), ("weights_loaded", self.weights_loaded_at),
                                      ("ready", self.ready_at), ("first_token", self.first_token_at))}


class MetricsBucket(models.Model):
    """Per-replica aggregates over one period (a minute, or an hour in the roll-up).

    Gauges are averaged and maxed over the scrapes in the period; counters and histograms are
    deltas (resets handled by the scraper). Histograms are {le: count} of bucket deltas, from
    which percentiles are estimated.
    """

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="+")
    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="+")
    start = models.DateTimeField()
    scrapes = models.PositiveIntegerField(default=0)
    running_avg = models.FloatField(default=0)
    running_max = models.FloatField(default=0)
    waiting_avg = models.FloatField(default=0)
    waiting_max = models.FloatField(default=0)
    kv_cache_usage_avg = models.FloatField(default=0)
    kv_cache_usage_max = models.FloatField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    generation_tokens = models.BigIntegerField(default=0)
    requests_by_reason = models.JSONField(default=dict, blank=True)  # {"stop": n, "length": n, ...}
    # The built-in engine's SLO scheduling (scraping.SLO_COUNTERS): {"judged": n, "missed_ttft": n,
    # "missed_tpot": n, "rejected_late": n, "served_late": n, "admitted": n, "admitted_late": n};
    # empty for a replica that does not export them.
    slo_scheduling = models.JSONField(default=dict, blank=True)
    preemptions = models.BigIntegerField(default=0)
    prefix_cache_queries = models.BigIntegerField(default=0)
    prefix_cache_hits = models.BigIntegerField(default=0)
    ttft_buckets = models.JSONField(default=dict, blank=True)
    ttft_sum = models.FloatField(default=0)
    ttft_count = models.BigIntegerField(default=0)
    itl_buckets = models.JSONField(default=dict, blank=True)
    itl_sum = models.FloatField(default=0)
    itl_count = models.BigIntegerField(default=0)
    e2e_buckets = models.JSONField(default=dict, blank=True)
    e2e_sum = models.FloatField(default=0)
    e2e_count = models.BigIntegerField(default=0)
    # GPU telemetry (dcgm-exporter's series: the replica's own, NVML's on its node, or the node's
    # dcgm-exporter; deployments/replicas/gpu_metrics.py). gpu_devices 0: none seen, so every other
    # gpu_* column is "not measured", never "idle". Per scrape: utilisation and SM clock are means
    # over the devices, memory and power sums, temperature the hottest device; over the period they
    # are averaged over the `gpu_scrapes` that carried GPU series (and maxed where named _max).
    gpu_devices = models.PositiveSmallIntegerField(default=0, help_text="GPUs seen (0: no GPU telemetry).")
    gpu_scrapes = models.PositiveIntegerField(default=0, help_text="Scrapes that carried GPU series.")
    gpu_minutes = models.PositiveSmallIntegerField(default=0, help_text="Minutes of the period with GPU series.")
    gpu_util_avg = models.FloatField(default=0, help_text="Percent, mean over the devices.")
    gpu_util_max = models.FloatField(default=0)
    gpu_memory_used_avg = models.FloatField(default=0, help_text="MiB, summed over the devices.")
    gpu_memory_total = models.FloatField(default=0, help_text="MiB (used + free), summed over the devices.")
    gpu_power_avg = models.FloatField(default=0, help_text="Watts, summed over the devices.")
    gpu_temp_max = models.FloatField(default=0, help_text="Degrees C, the hottest device.")
    gpu_sm_clock_avg = models.FloatField(default=0, help_text="MHz, mean over the devices.")

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"replica {self.replica_id} @ {self.start:%Y-%m-%d %H:%M}"


class ReplicaMetricsMinute(MetricsBucket):
    class Meta:
        db_table = "runtime_replicametricsminute"
        constraints = [models.UniqueConstraint(fields=["replica", "start"], name="unique_minute_per_replica")]
        indexes = [models.Index(fields=["deployment", "start"]), models.Index(fields=["start"])]


class ReplicaMetricsHour(MetricsBucket):
    class Meta:
        db_table = "runtime_replicametricshour"
        constraints = [models.UniqueConstraint(fields=["replica", "start"], name="unique_hour_per_replica")]
        indexes = [models.Index(fields=["deployment", "start"]), models.Index(fields=["start"])]
