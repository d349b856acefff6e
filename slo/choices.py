from django.db import models


class Scope(models.TextChoices):
    DEPLOYMENT = "deployment", "One deployment"
    MODEL = "model", "All deployments of a model"
    TENANT = "tenant", "One tenant on one deployment"


class SliKind(models.TextChoices):
    AVAILABILITY = "availability", "Availability"
    LATENCY = "latency", "Latency"
    GOODPUT = "goodput", "Goodput"
    RATIO = "ratio", "Ratio of two scraped series"
    QUALITY = "quality", "Quality: eval cases passed"


class Window(models.TextChoices):
    DAY = "1d", "Rolling 1 day"
    WEEK = "7d", "Rolling 7 days"
    FOUR_WEEKS = "28d", "Rolling 28 days"
    MONTH = "30d", "Rolling 30 days"
    CALENDAR_WEEK = "calendar-week", "Calendar week"
    CALENDAR_MONTH = "calendar-month", "Calendar month"


class Budgeting(models.TextChoices):
    OCCURRENCES = "occurrences", "Occurrences"
    TIMESLICES = "timeslices", "Timeslices (minutes)"


class SloState(models.TextChoices):
    OK = "ok", "OK"
    WARNING = "warning", "Warning"
    EXHAUSTED = "exhausted", "Exhausted"
    # Fewer events in the window than the SLO's min_requests: too few to judge, so the budget is
    # not called exhausted, burn-rate alerts do not fire and rollouts are not refused on it.
    INSUFFICIENT = "insufficient", "Insufficient traffic"


# Counter columns of deployments.models.ReplicaMetricsMinute a ratio SLI may name; "requests" is the
# sum of requests_by_reason (finished requests of any reason).
RATIO_SERIES = (
    "requests", "prompt_tokens", "generation_tokens", "preemptions", "prefix_cache_queries",
    "prefix_cache_hits", "ttft_count", "itl_count", "e2e_count",
)

# A quality SLI's schedule: an eval run every eval_every_s, never more often than this (a run holds
# replica capacity, and the minute rows it feeds are per minute).
MIN_EVAL_EVERY_S = 300
MAX_EVAL_EVERY_S = 30 * 86400  # the longest rolling window: a rarer run leaves windows without one
