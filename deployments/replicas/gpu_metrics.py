"""A replica's GPUs from dcgm-exporter's series, whichever of three sources has them.

- Its own /metrics: the built-in engine exports `DCGM_FI_DEV_*` beside its `vllm:` series.
- NVML on the worker's node, for a replica of the local driver whose page has none (vLLM): the
  devices the node's GPU ledger says the replica holds, rendered as DCGM text by
  runtime/gpu_telemetry.py (`GpuSource.devices`).
- The dcgm-exporter pod on a Kubernetes replica pod's node (`GpuSource.url`), keeping the series
  that dcgm-exporter labels with that pod (`pod`/`namespace`, its pod mapping); without such labels
  it keeps every device of the node and says so in a note.

All three are Prometheus text under the same names, read by one parser (`gpu_stats`). Per scrape,
utilisation and SM clock are means over the devices, memory and power sums, temperature the
hottest device.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# GpuStats field -> dcgm-exporter family (a gauge per device).
GPU_FAMILIES = {
    "util": "DCGM_FI_DEV_GPU_UTIL",  # percent
    "fb_used": "DCGM_FI_DEV_FB_USED",  # MiB
    "fb_free": "DCGM_FI_DEV_FB_FREE",  # MiB
    "power": "DCGM_FI_DEV_POWER_USAGE",  # W
    "temp": "DCGM_FI_DEV_GPU_TEMP",  # C
    "sm_clock": "DCGM_FI_DEV_SM_CLOCK",  # MHz
}
_GPU_LINE = re.compile(
    r"^(?:# (?:HELP|TYPE) )?(?:" + "|".join(GPU_FAMILIES.values()) + r")[ {]", re.MULTILINE)
NO_POD_MAPPING = ("dcgm-exporter labels none of its series with a pod (its Kubernetes pod mapping is off): "
                  "these are every GPU of the node, not only the pod's")


class GpuParseError(ValueError):
    pass


@dataclass(frozen=True)
class GpuSource:
    """Where a scrape target's GPU series come from when its own /metrics has none."""

    devices: tuple[str, ...] = ()  # NVML on this node: the devices the replica holds (local driver)
    hostname: str = ""  # the node, for the Hostname label of the rendered series
    url: str = ""  # a dcgm-exporter's base URL (Kubernetes: the one on the pod's node)
    pod: str = ""  # the pod whose GPUs' series to keep, and its namespace
    namespace: str = ""
    error: str = ""  # why there is no source for this target (no dcgm-exporter on its node, ...)


@dataclass(frozen=True)
class GpuStats:
    """One scrape's GPUs."""

    devices: int
    util_percent: float  # mean over the devices
    memory_used_mib: float  # summed over the devices
    memory_total_mib: float  # summed over the devices: used + free
    power_watts: float  # summed over the devices
    temp_max_c: float  # the hottest device
    sm_clock_mhz: float  # mean over the devices


def gpu_stats(by_name: dict[str, list], *, pod: str = "", namespace: str = "") -> tuple[GpuStats | None, str]:
    """The GPUs in parsed samples ({sample name: [Sample]}), with a note (or ""); None when none.

    With `pod`, only the devices dcgm-exporter labels with that pod (and namespace) count, unless it
    labels none with any pod: then every device counts, and the note says so.
    """
    samples = [(key, s) for key, family in GPU_FAMILIES.items() for s in by_name.get(family, [])]
    note = ""
    if pod:
        if any(_pod(s.labels) for _, s in samples):
            samples = [(key, s) for key, s in samples
                       if _pod(s.labels) == pod and _namespace(s.labels) in ("", namespace)]
        else:
            note = NO_POD_MAPPING
    per_device: dict[str, dict[str, float]] = defaultdict(dict)
    for key, s in samples:
        device = s.labels.get("UUID") or s.labels.get("gpu") or s.labels.get("device") or ""
        per_device[device][key] = s.value
    if not per_device:
        return None, note
    devices = list(per_device.values())

    def values(key: str) -> list[float]:
        return [device[key] for device in devices if key in device]

    def mean(key: str) -> float:
        found = values(key)
        return sum(found) / len(found) if found else 0.0

    used = sum(values("fb_used"))
    return GpuStats(
        devices=len(devices), util_percent=mean("util"), memory_used_mib=used,
        memory_total_mib=used + sum(values("fb_free")), power_watts=sum(values("power")),
        temp_max_c=max(values("temp"), default=0.0), sm_clock_mhz=mean("sm_clock"),
    ), note


def _pod(labels: dict) -> str:
    # dcgm-exporter before 2.4 named them pod_name / pod_namespace (and still does with its
    # "use old namespace" option).
    return labels.get("pod") or labels.get("pod_name") or ""


def _namespace(labels: dict) -> str:
    return labels.get("namespace") or labels.get("pod_namespace") or ""


def samples_by_name(text: str, wanted_line: re.Pattern) -> dict[str, list]:
    """The samples of a Prometheus text page's lines that `wanted_line` matches (the rest are never
    parsed), by their own names (`..._total`, `..._bucket`), which holds whether or not the page
    declared the families' types. Raises ValueError for text the parser cannot read."""
    relevant = "\n".join(line for line in text.splitlines() if wanted_line.match(line)) + "\n"
    by_name: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(relevant):
        for sample in family.samples:
            by_name[sample.name].append(sample)
    return by_name


def parse_gpu_text(text: str, *, pod: str = "", namespace: str = "") -> tuple[GpuStats | None, str]:
    """gpu_stats of a Prometheus text page (dcgm-exporter's, or NVML's rendered); raises GpuParseError."""
    try:
        by_name = samples_by_name(text, _GPU_LINE)
    except ValueError as error:
        raise GpuParseError(f"unparsable GPU metrics: {error}") from None
    return gpu_stats(by_name, pod=pod, namespace=namespace)


def combine_gpu(stats: list[GpuStats]) -> GpuStats | None:
    """One replica's GPUs from its pods' (a row that holds two pods): devices add up."""
    if not stats:
        return None
    if len(stats) == 1:
        return stats[0]
    devices = sum(s.devices for s in stats)
    return GpuStats(
        devices=devices,
        util_percent=sum(s.util_percent * s.devices for s in stats) / devices,
        memory_used_mib=sum(s.memory_used_mib for s in stats),
        memory_total_mib=sum(s.memory_total_mib for s in stats),
        power_watts=sum(s.power_watts for s in stats),
        temp_max_c=max(s.temp_max_c for s in stats),
        sm_clock_mhz=sum(s.sm_clock_mhz * s.devices for s in stats) / devices,
    )


def nvml_text(devices: list[str], hostname: str) -> str:
    """The devices' series as NVML reads them now, in dcgm-exporter's text ("" without NVML)."""
    # Imported here: the web process never reads NVML, and the module loads pynvml lazily itself.
    from runtime import gpu_telemetry

    return gpu_telemetry.render_dcgm(gpu_telemetry.read_gpus(devices), hostname=hostname or None)
