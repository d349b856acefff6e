"""What a goodput curve is measured against and how long it may be, shared by the load generator and the
control plane's curve API without importing the load generator (numpy, aiohttp: not in the web image)."""

SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_CURVE_STEPS = 50
