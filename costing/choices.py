from django.db import models


class Tier(models.TextChoices):
    ON_DEMAND = "on-demand", "On-demand"
    RESERVED = "reserved", "Reserved"
    SPOT = "spot", "Spot"


class BudgetBasis(models.TextChoices):
    ACTUAL = "actual", "Actual spend"
    FORECAST = "forecast", "Forecast spend (linear from the month so far)"


# What a price names: fixed names, or a prefix and a name (`gpu:H100`, `node:worker-3`).
FIXED_RESOURCES = ("cpu", "memory")
PREFIXED_RESOURCES = ("gpu", "node")
RESOURCE_UNITS = {"cpu": "core-hour", "memory": "GiB-hour", "gpu": "GPU-hour", "node": "node-hour"}
