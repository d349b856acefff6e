"""One health verdict per deployment for the overview rows (home page, deployment list): healthy,
at risk or unhealthy, with the reasons in words. Pure: the figures come in as plain values, so a
`ready` status with an exhausted budget and a degradation level in force cannot read as green.
"""

from __future__ import annotations

from dataclasses import dataclass

HEALTHY, AT_RISK, UNHEALTHY = "healthy", "at-risk", "unhealthy"
LABELS = {HEALTHY: "healthy", AT_RISK: "at risk", UNHEALTHY: "unhealthy"}

# Server failures over the overview's window; below MIN_REQUESTS one failed request is noise.
ERROR_RATE_AT_RISK = 0.01
ERROR_RATE_UNHEALTHY = 0.05
MIN_REQUESTS = 20


@dataclass(frozen=True)
class Verdict:
    level: str
    reasons: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return LABELS[self.level]

    @property
    def text(self) -> str:
        return "; ".join(self.reasons)


def _replica_reasons(status: str, ready: int, desired: int) -> list[tuple[str, str]]:
    if status == "failed":
        return [(UNHEALTHY, "replicas failing")]
    if desired > 0 and ready == 0:
        return [(UNHEALTHY, f"no replica ready of {desired}")]
    if ready < desired:
        return [(AT_RISK, f"{ready} of {desired} replicas ready")]
    return []


def _slo_reasons(slos: list[dict]) -> list[tuple[str, str]]:
    reasons = []
    for slo in slos:
        if slo["state"] == "exhausted":
            reasons.append((UNHEALTHY, f"SLO {slo['name']} budget exhausted"))
        elif slo["state"] == "warning":
            reasons.append((AT_RISK, f"SLO {slo['name']} budget burning"))
    return reasons


def _error_reasons(requests: int, error_rate: float | None) -> list[tuple[str, str]]:
    if error_rate is None or requests < MIN_REQUESTS or error_rate < ERROR_RATE_AT_RISK:
        return []
    level = UNHEALTHY if error_rate >= ERROR_RATE_UNHEALTHY else AT_RISK
    return [(level, f"{error_rate * 100:.1f} % of requests failing")]


def _degradation_reasons(degradation: dict | None) -> list[tuple[str, str]]:
    level = (degradation or {}).get("level") or 0
    if not level:
        return []
    name = (degradation or {}).get("name")
    return [(AT_RISK, f"degraded to level {level}" + (f" ({name})" if name else ""))]


def health_verdict(*, status: str, ready: int, desired: int, slos: list[dict], degradation: dict | None,
                   requests: int, error_rate: float | None) -> Verdict:
    """The worst level any signal reaches, with every reason, the unhealthy ones first.

    slos: [{"name", "state"}] as deployments.overview reads them; degradation: the level in force
    ({"level", "name"}) or None.
    """
    found = (_replica_reasons(status, ready, desired) + _slo_reasons(slos)
             + _error_reasons(requests, error_rate) + _degradation_reasons(degradation))
    if not found:
        return Verdict(HEALTHY)
    ordered = sorted(found, key=lambda reason: reason[0] != UNHEALTHY)  # stable: unhealthy first
    return Verdict(ordered[0][0], tuple(text for _, text in ordered))
