"""GPU telemetry read through NVML, exported under dcgm-exporter's names and labels.

A replica that holds GPUs serves, per device, `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_FB_USED` and
`DCGM_FI_DEV_FB_FREE` (MiB), `DCGM_FI_DEV_POWER_USAGE` (W), `DCGM_FI_DEV_GPU_TEMP` (C) and
`DCGM_FI_DEV_SM_CLOCK` (MHz), labelled `gpu`, `UUID`, `device`, `modelName` and `Hostname` as
dcgm-exporter labels them, so dashboards made for dcgm-exporter read a replica unchanged.

NVML comes from `nvidia-ml-py` (module `pynvml`), imported only when first read: the gateway and
web images import this module and nothing heavy. Reading never raises: without the package, the
library or a driver it gives no devices, and a query a device refuses leaves that one field out,
each logged once per process rather than once per scrape.

`python -m runtime.gpu_telemetry --record out.json` writes every NVML answer this module reads, as
JSON; `ReplayNvml(out.json)` answers from such a recording with pynvml's function names, which is
how the tests (and anyone without a GPU) run this code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
LABEL_NAMES = ("gpu", "UUID", "device", "modelName", "Hostname")

# NVML's constants (nvml.h), so a recording can be replayed where pynvml is not imported.
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_FOUND = 6


@dataclass(frozen=True)
class GpuSample:
    """One device's reading. A measurement NVML refused (a board without power readings, say) is None."""

    index: int  # NVML's index, as dcgm-exporter's `gpu` label (not the index within CUDA_VISIBLE_DEVICES)
    uuid: str
    name: str
    util_percent: float | None
    fb_used_mib: float | None
    fb_free_mib: float | None
    fb_total_mib: float | None
    power_watts: float | None
    temp_c: float | None
    sm_clock_mhz: float | None


# (series, help, GpuSample attribute)
DCGM_SERIES = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilisation, in percent.", "util_percent"),
    ("DCGM_FI_DEV_FB_USED", "Frame buffer memory in use, in MiB.", "fb_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Frame buffer memory free, in MiB.", "fb_free_mib"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power drawn by the device, in W.", "power_watts"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature, in degrees C.", "temp_c"),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock, in MHz.", "sm_clock_mhz"),
)


# -- reading --------------------------------------------------------------------------------------

class _Session:
    """NVML for one module (pynvml, or a replay): initialised once, or remembered as unavailable."""

    def __init__(self, nvml: Any | None) -> None:
        self.nvml = nvml
        self.available: bool | None = None  # None: not tried yet
        self.lock = threading.Lock()
        self.warned: set[tuple] = set()

    def start(self) -> bool:
        if self.available is None:
            with self.lock:
                if self.available is None:
                    self.available = self._init()
        return self.available

    def _init(self) -> bool:
        if self.nvml is None:
            try:
                import pynvml
            except ImportError:
                logger.warning("no GPU telemetry: the nvidia-ml-py package (pynvml) is not installed")
                return False
            self.nvml = pynvml
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, _NoPermission...
            logger.warning("no GPU telemetry: NVML did not start (%s: %s)", type(exc).__name__, exc)
            return False
        # Never shut down: NVML stays initialised for the life of the process, read at every scrape.
        return True

    def warn_once(self, key: tuple, message: str, *args: Any) -> None:
        with self.lock:
            if key in self.warned:
                return
            self.warned.add(key)
        logger.warning(message, *args)

    def query(self, index: int | None, what: str, call: Callable[[], Any]) -> Any | None:
        """`call()`, or None (logged once per device and field) when NVML refuses it."""
        try:
            return call()
        except Exception as exc:
            device = "" if index is None else f" of GPU {index}"
            self.warn_once((index, what), "GPU telemetry: NVML gave no %s%s (%s: %s); left out",
                           what, device, type(exc).__name__, exc)
            return None

    def visible(self, devices: Sequence[str] | None) -> list[tuple[int, Any]]:
        """(NVML index, handle) of the devices `devices` names, in its order; all of them for None."""
        nvml = self.nvml
        count = self.query(None, "device count", nvml.nvmlDeviceGetCount)
        if not count:
            return []
        handles = [(i, self.query(i, "handle", lambda i=i: nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        handles = [(i, handle) for i, handle in handles if handle is not None]
        if devices is None:
            return handles
        chosen: list[tuple[int, Any]] = []
        for entry in devices:
            found = self._resolve(entry.strip(), handles)
            if found is None:
                # CUDA ignores every entry after one it cannot resolve; so does this.
                self.warn_once(("devices", entry), "GPU telemetry: no device %r (from %r); it and those after "
                               "it are left out, as CUDA leaves them out", entry, ",".join(devices))
                break
            if found not in chosen:
                chosen.append(found)
        return chosen

    def _resolve(self, entry: str, handles: list[tuple[int, Any]]) -> tuple[int, Any] | None:
        if entry.isdigit():
            return next(((i, h) for i, h in handles if i == int(entry)), None)
        if not entry.startswith("GPU-"):  # MIG-... instances and anything else: not read here
            return None
        # CUDA accepts any unique prefix of a UUID.
        matches = [(i, h) for i, h in handles
                   if _text(self.query(i, "UUID", lambda h=h: self.nvml.nvmlDeviceGetUUID(h)) or "").startswith(entry)]
        return matches[0] if len(matches) == 1 else None

    def sample(self, index: int, handle: Any) -> GpuSample | None:
        nvml = self.nvml
        uuid = self.query(index, "UUID", lambda: nvml.nvmlDeviceGetUUID(handle))
        if uuid is None:  # without it no series could be told from another device's
            return None
        name = self.query(index, "name", lambda: nvml.nvmlDeviceGetName(handle))
        util = self.query(index, "utilisation", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        memory = self.query(index, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = self.query(index, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        temp = self.query(index, "temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU))
        clock = self.query(index, "SM clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM))
        return GpuSample(
            index=index, uuid=_text(uuid), name=_text(name or ""),
            util_percent=_number(util),
            # Whole MiB, as DCGM reports frame buffer sizes.
            fb_used_mib=None if memory is None else float(memory.used // MIB),
            fb_free_mib=None if memory is None else float(memory.free // MIB),
            fb_total_mib=None if memory is None else float(memory.total // MIB),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temp_c=_number(temp), sm_clock_mhz=_number(clock))


_sessions: dict[int, tuple[Any, _Session]] = {}
_sessions_lock = threading.Lock()


def _session(nvml: Any | None) -> _Session:
    # Keyed by identity, holding the module too, so an id is never reused for another one.
    with _sessions_lock:
        entry = _sessions.get(id(nvml))
        if entry is None:
            entry = _sessions[id(nvml)] = (nvml, _Session(nvml))
        return entry[1]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # older pynvml answers bytes


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def visible_devices() -> list[str] | None:
    """This process's CUDA_VISIBLE_DEVICES entries, or None (every device) when it is not set."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is None:
        return None
    return [entry for entry in (item.strip() for item in configured.split(",")) if entry]


def read_gpus(devices: list[str] | None = None, nvml: Any | None = None) -> list[GpuSample]:
    """A sample of each device `devices` names (indexes "0", "3" or UUIDs "GPU-...", as in
    CUDA_VISIBLE_DEVICES); None reads those this process may use. `nvml` answers with pynvml's
    function names (pynvml itself by default). Never raises: no NVML gives []."""
    session = _session(nvml)
    if not session.start():
        return []
    if devices is None:
        devices = visible_devices()
    samples = (session.sample(index, handle) for index, handle in session.visible(devices))
    return [sample for sample in samples if sample is not None]


# -- exporting ------------------------------------------------------------------------------------

def hostname() -> str:
    """The `Hostname` label's value, chosen as dcgm-exporter chooses it: NODE_NAME, else the host's name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def dcgm_families(samples: Iterable[GpuSample], host: str | None = None) -> list[Metric]:
    """One gauge family per DCGM series that any sample has a value for."""
    samples = list(samples)
    host = host or hostname()
    families = []
    for series, help_text, attribute in DCGM_SERIES:
        family = GaugeMetricFamily(series, help_text, labels=LABEL_NAMES)
        for sample in samples:
            value = getattr(sample, attribute)
            if value is not None:
                family.add_metric([str(sample.index), sample.uuid, f"nvidia{sample.index}", sample.name, host], value)
        if family.samples:
            families.append(family)
    return families


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def render_dcgm(samples: list[GpuSample], hostname: str | None = None) -> str:
    """The Prometheus text a dcgm-exporter on that host would serve for these samples (these series)."""
    return generate_latest(_Families(dcgm_families(samples, hostname))).decode()


class GpuCollector(Collector):
    """Reads the devices at scrape time; yields nothing where there are none (a CPU replica)."""

    def __init__(self, devices: list[str] | None = None, nvml: Any | None = None,
                 hostname: str | None = None) -> None:
        self.devices = devices
        self.nvml = nvml
        self.hostname = hostname

    def collect(self) -> Iterable[Metric]:
        samples = read_gpus(self.devices, self.nvml)
        if samples:
            yield from dcgm_families(samples, self.hostname)


# -- recording and replaying NVML's answers -------------------------------------------------------

def _answer(call: Callable[[], Any], shape: Callable[[Any], Any] = lambda value: value) -> Any:
    try:
        return shape(call())
    except Exception as exc:
        return {"error": type(exc).__name__, "code": getattr(exc, "value", None), "message": str(exc)}


def record(path: str | Path, nvml: Any | None = None) -> dict:
    """Writes every NVML answer this module reads, for each device, as JSON (ReplayNvml's input)."""
    recording: dict[str, Any] = {"format": 1}
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            nvml = None
            recording["nvmlInit"] = {"error": "ImportError", "code": None, "message": str(exc)}
    if nvml is not None:
        started = _answer(nvml.nvmlInit)
        recording["nvmlInit"] = started
        if started is None:
            try:
                recording["nvmlSystemGetDriverVersion"] = _answer(nvml.nvmlSystemGetDriverVersion, _text)
                count = _answer(nvml.nvmlDeviceGetCount)
                recording["nvmlDeviceGetCount"] = count
                recording["devices"] = [_record_device(nvml, index)
                                        for index in range(count if isinstance(count, int) else 0)]
            finally:
                nvml.nvmlShutdown()
    Path(path).write_text(json.dumps(recording, indent=2) + "\n")
    return recording


def _record_device(nvml: Any, index: int) -> dict:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return {"nvmlDeviceGetHandleByIndex": _answer(lambda: nvml.nvmlDeviceGetHandleByIndex(index))}
    return {
        "nvmlDeviceGetName": _answer(lambda: nvml.nvmlDeviceGetName(handle), _text),
        "nvmlDeviceGetUUID": _answer(lambda: nvml.nvmlDeviceGetUUID(handle), _text),
        "nvmlDeviceGetUtilizationRates": _answer(lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
                                                 lambda u: {"gpu": u.gpu, "memory": u.memory}),
        "nvmlDeviceGetMemoryInfo": _answer(lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
                                           lambda m: {"total": m.total, "free": m.free, "used": m.used}),
        "nvmlDeviceGetPowerUsage": _answer(lambda: nvml.nvmlDeviceGetPowerUsage(handle)),
        "nvmlDeviceGetTemperature": {"NVML_TEMPERATURE_GPU": _answer(
            lambda: nvml.nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU))},
        "nvmlDeviceGetClockInfo": {"NVML_CLOCK_SM": _answer(
            lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM))},
    }


class _Fields:
    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)


class ReplayNvml:
    """Answers pynvml's calls (those this module makes) from a recording made by `record`.

    A recorded error is raised as pynvml raises it (NVMLError_NotSupported for code 3, ...), and a
    recorded failed start makes nvmlInit raise, so every path of `read_gpus` runs without a GPU."""

    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = NVML_CLOCK_SM

    def __init__(self, recording: str | Path | dict) -> None:
        if not isinstance(recording, dict):
            recording = json.loads(Path(recording).read_text())
        self.recording = recording
        self.devices: list[dict] = recording.get("devices", [])
        self.started = False

    @property
    def NVMLError(self) -> type[Exception]:  # noqa: N802 (pynvml's name)
        import pynvml
        return pynvml.NVMLError

    def _raise(self, error: dict) -> None:
        import pynvml
        if error.get("code") is None:
            raise ImportError(error.get("message", "pynvml is not installed"))
        raise pynvml.NVMLError(error["code"])

    def _give(self, answer: Any) -> Any:
        if isinstance(answer, dict) and "error" in answer:
            self._raise(answer)
        return answer

    def _device(self, handle: int) -> dict:
        if not self.started:
            self._raise({"code": NVML_ERROR_UNINITIALIZED})
        return self.devices[handle]

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names, here and below)
        self._give(self.recording.get("nvmlInit"))
        self.started = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.started = False

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self._give(self.recording.get("nvmlSystemGetDriverVersion"))

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        if not self.started:
            self._raise({"code": NVML_ERROR_UNINITIALIZED})
        return self._give(self.recording.get("nvmlDeviceGetCount", len(self.devices)))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if not 0 <= index < len(self.devices):
            self._raise({"code": NVML_ERROR_INVALID_ARGUMENT})
        self._give(self._device(index).get("nvmlDeviceGetHandleByIndex"))
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:  # noqa: N802
        for index, device in enumerate(self.devices):
            if device.get("nvmlDeviceGetUUID") == _text(uuid):
                return self.nvmlDeviceGetHandleByIndex(index)
        self._raise({"code": NVML_ERROR_NOT_FOUND})

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return self._give(self._device(handle)["nvmlDeviceGetName"])

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return self._give(self._device(handle)["nvmlDeviceGetUUID"])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> _Fields:  # noqa: N802
        return _Fields(self._give(self._device(handle)["nvmlDeviceGetUtilizationRates"]))

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Fields:  # noqa: N802
        return _Fields(self._give(self._device(handle)["nvmlDeviceGetMemoryInfo"]))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802
        return self._give(self._device(handle)["nvmlDeviceGetPowerUsage"])

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802
        return self._answer_for(handle, "nvmlDeviceGetTemperature", {NVML_TEMPERATURE_GPU: "NVML_TEMPERATURE_GPU"},
                                sensor)

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> int:  # noqa: N802
        return self._answer_for(handle, "nvmlDeviceGetClockInfo", {NVML_CLOCK_SM: "NVML_CLOCK_SM"}, clock)

    def _answer_for(self, handle: int, call: str, names: dict[int, str], argument: int) -> Any:
        answers = self._device(handle)[call]
        if argument not in names or names[argument] not in answers:
            self._raise({"code": NVML_ERROR_INVALID_ARGUMENT})
        return self._give(answers[names[argument]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.gpu_telemetry",
                                     description="Read this machine's GPUs through NVML.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", metavar="OUT.json",
                        help="write every NVML answer read, per device, as JSON (replayed by ReplayNvml)")
    action.add_argument("--print", action="store_true", dest="print_",
                        help="print the DCGM series of the devices this process may use")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if args.record:
        recording = record(args.record)
        print(f"{args.record}: {len(recording.get('devices', []))} device(s), "
              f"nvmlInit: {recording.get('nvmlInit') or 'ok'}", file=sys.stderr)
    else:
        sys.stdout.write(render_dcgm(read_gpus()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
