"""OpenSLO v1 YAML import and export.

inferops reads and writes the kinds Service, SLI, SLO, AlertPolicy and AlertCondition (burnrate).
The mapping, field by field:

- SLO `metadata.name` is the SLO's name; `spec.description` its description; `spec.service` the
  deployment it covers (for a model-scoped SLO: the model). `metadata.annotations` under
  `inferops.io/` carry what OpenSLO has no field for: scope, tenant, owner, runbook URL and the
  minimum-traffic guard.
- The indicator (inline, or an SLI document named by `indicatorRef`) reads a metric source of type
  `inferops` whose spec names the SLI kind and its parameters: a latency SLI is a `thresholdMetric`
  (`{sli: latency, ttftMs, tpotMs, e2eMs}`); availability, goodput and ratio SLIs are `ratioMetric`s
  with `good` and `total` sources (goodput's thresholds on `good`, a ratio's scraped series as
  `series` on each).
- `timeWindow`: rolling 1d/7d/28d/30d, or calendar-aligned 1w/1M with a start at the beginning of a
  week (Monday 00:00) or month and a time zone.
- `budgetingMethod` Occurrences or Timeslices (one-minute slices with a `timeSliceTarget`); exactly
  one objective with a `target` (or `targetPercent`).
- `alertPolicies` describe inferops' burn-rate alerting, which is always the standard multiwindow
  set (`slo.budget.alert_rules`): a policy naming any other burn rate or window is refused. An
  AlertCondition's `lookbackWindow` is the long window and `alertAfter` the short window that must
  burn as well before the alert fires.
- A quality SLO (the pass rate of inferops' eval runs) is a `ratioMetric` of the source
  `{sli: quality, cases: passed}` over `{sli: quality, cases: all}`; its objective is the floor.
  Annotations name its eval set (`inferops.io/eval-set`) and schedule (`inferops.io/eval-every`,
  a duration such as 6h). It pages when the latest run scores below the floor, which no burnrate
  condition says: export writes no alert policy and says so in `inferops.io/alerting`; import
  accepts that annotation as prose and refuses alert policies on a quality SLO.

Everything else is refused, each unsupported field with its own path and reason, so that what is
accepted round-trips: export(import(x)) equals x for documents in the form export writes. Prose
that inferops does not keep (descriptions of Service, SLI, AlertPolicy and AlertCondition
documents, the names of inline SLIs, policies and conditions) is accepted and written anew.
So are `metadata.displayName` and `metadata.labels` of Service, SLI and SLO documents (and of
an inline indicator): checked for shape (a string; a mapping of strings to a string or a list of
strings), then accepted and not kept, so export writes neither.
"""

from __future__ import annotations

import enum
import re
import zoneinfo
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

import yaml

from slo.budget import ROLLING_DAYS, alert_rules
from slo.choices import RATIO_SERIES, Budgeting, Scope, SliKind, Window

API_VERSION = "openslo/v1"
SOURCE_TYPE = "inferops"
ANNOTATION_PREFIX = "inferops.io/"
DEFAULT_MIN_REQUESTS = 20
TIMESLICE_WINDOW = "1m"
KINDS = ("Service", "SLI", "SLO", "AlertPolicy", "AlertCondition")

DAY = 86400
CALENDAR_WINDOWS = {"1w": Window.CALENDAR_WEEK, "1M": Window.CALENDAR_MONTH}
# Any Monday and any first of a month at midnight serve as the anchor of a calendar window.
CALENDAR_ANCHOR = "2024-01-01 00:00:00"
LATENCY_KEYS = {"ttftMs": "ttft_ms", "tpotMs": "tpot_ms", "e2eMs": "e2e_ms"}
ANNOTATIONS = {"scope": "scope", "tenant": "tenant", "owner": "owner", "runbook-url": "runbook_url",
               "min-requests": "min_requests", "eval-set": "eval_set", "eval-every": "eval_every_s",
               "alerting": None}
# What a quality SLO's alerting is, in words: OpenSLO's alert conditions are burn rates only.
QUALITY_ALERTING = ("pages when the latest eval run scores below the objective (the floor) and resolves when a "
                    "later run is back at or above it; not a burn rate, so no OpenSLO alert policy")
QUALITY_CASES = {"good": "passed", "total": "all"}


SHORTHAND = re.compile(r"^([1-9][0-9]*)([mhdwMQY])$")
SHORTHAND_SECONDS = {"m": 60, "h": 3600, "d": DAY, "w": 7 * DAY}


def duration_shorthand(seconds: int) -> str:
    """OpenSLO's duration shorthand for whole minutes, in the largest unit that divides evenly."""
    for unit, size in (("d", DAY), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    raise ValueError(f"{seconds} s is not a whole number of minutes")


def shorthand_seconds(value: Any) -> int | None:
    """Seconds of a shorthand in m/h/d/w; None for anything else (months have no fixed length)."""
    match = SHORTHAND.match(value) if isinstance(value, str) else None
    if not match or match.group(2) not in SHORTHAND_SECONDS:
        return None
    return int(match.group(1)) * SHORTHAND_SECONDS[match.group(2)]


class OpenSloRefused(Exception):
    """The documents use what inferops does not support; `problems` lists every one."""

    def __init__(self, problems: list[Problem]):
        super().__init__(f"{len(problems)} unsupported field(s) in the OpenSLO documents")
        self.problems = problems

    def as_json(self) -> dict:
        return {"detail": str(self), "unsupported": [p.as_json() for p in self.problems]}


@dataclass(frozen=True)
class Problem:
    document: int
    kind: str
    name: str
    path: str
    message: str

    def as_json(self) -> dict:
        return {"document": self.document, "kind": self.kind, "name": self.name, "field": self.path,
                "message": self.message}

    def __str__(self) -> str:
        return f"document {self.document} ({self.kind} {self.name}): {self.path}: {self.message}"


@dataclass
class Document:
    index: int
    kind: str
    name: str
    body: dict


@dataclass
class Reader:
    """Walks one document, collecting a Problem for every unsupported field instead of stopping."""

    document: Document
    problems: list[Problem]
    checked: set = field(default_factory=set)

    def refuse(self, path: str, message: str) -> None:
        self.problems.append(Problem(self.document.index, self.document.kind, self.document.name, path, message))

    def mapping(self, value: Any, path: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict:
        """The mapping at `path` (empty when it is not one); unknown and missing keys are refused."""
        if not isinstance(value, dict):
            self.refuse(path, "must be a mapping")
            return {}
        for key in value:
            if key not in allowed:
                self.refuse(f"{path}.{key}" if path else str(key), "not supported by inferops")
        for key in required:
            if key not in value:
                self.refuse(f"{path}.{key}" if path else key, "required")
        return value

    def expect(self, value: Any, path: str, wanted: Any, message: str) -> None:
        if value != wanted:
            self.refuse(path, message)


def parse_documents(text: str) -> list[dict]:
    """YAML documents of a stream, skipping empty ones; raises ValueError on malformed YAML."""
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"Not valid YAML: {exc}") from None
    flat: list[dict] = []
    for doc in documents:
        # Some tools write a list of objects in one document; accept both shapes.
        flat.extend(doc if isinstance(doc, list) else [doc])
    return flat


def definitions_from_documents(raw_documents: list) -> list[dict]:
    """SLO definitions (keyword arguments for slo_create, with deployment and model as names).

    Raises OpenSloRefused listing every unsupported field of every document.
    """
    return [definition for _, definition in read_documents(raw_documents)]


def read_documents(raw_documents: list) -> list[tuple[int, dict]]:
    """(document index, definition) of every SLO document; raises OpenSloRefused."""
    problems: list[Problem] = []
    documents = index_documents(raw_documents, problems)
    by_kind: dict[str, dict[str, Document]] = {kind: {} for kind in KINDS}
    for doc in documents:
        # Several SLOs of one service may each bring its Service document; other kinds are named
        # by references, which must not be ambiguous.
        if doc.name in by_kind[doc.kind] and doc.kind != "Service":
            Reader(doc, problems).refuse("metadata.name", f"a second {doc.kind} with this name")
        by_kind[doc.kind][doc.name] = doc
    for doc in by_kind["Service"].values():
        read_service(Reader(doc, problems))
    definitions = [(doc.index, read_slo(Reader(doc, problems), by_kind)) for doc in by_kind["SLO"].values()]
    if not definitions and not problems:
        problems.append(Problem(-1, "", "", "", "no SLO document found"))
    if problems:
        raise OpenSloRefused(problems)
    return definitions


def index_documents(raw_documents: list, problems: list[Problem]) -> list[Document]:
    documents = []
    for index, raw in enumerate(raw_documents):
        if not isinstance(raw, dict):
            problems.append(Problem(index, "", "", "", "an OpenSLO document must be a mapping"))
            continue
        kind = raw.get("kind") if isinstance(raw.get("kind"), str) else ""
        metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
        name = metadata.get("name") if isinstance(metadata.get("name"), str) else ""
        reader = Reader(Document(index, kind, name, raw), problems)
        reader.mapping(raw, "", {"apiVersion", "kind", "metadata", "spec"}, ("apiVersion", "kind", "metadata", "spec"))
        if "apiVersion" in raw:
            reader.expect(raw["apiVersion"], "apiVersion", API_VERSION, f'only "{API_VERSION}" is supported')
        if kind not in KINDS:
            reader.refuse("kind", f"{raw.get('kind')!r} is not supported (inferops reads {', '.join(KINDS)})")
            continue
        if not name:
            reader.refuse("metadata.name", "required")
            continue
        documents.append(reader.document)
    return documents


def read_metadata(reader: Reader, value: Any, path: str, allowed: set[str]) -> dict:
    """A metadata mapping that may also carry displayName and labels, which inferops accepts
    (tools such as Nobl9 and Sloth write them) but does not keep."""
    metadata = reader.mapping(value, path, allowed | {"displayName", "labels"})
    if "displayName" in metadata and not isinstance(metadata["displayName"], str):
        reader.refuse(f"{path}.displayName", "must be a string")
    labels = metadata.get("labels", {})
    if not isinstance(labels, dict):
        reader.refuse(f"{path}.labels", "must be a mapping of label names to values")
        return metadata
    for key, label in labels.items():
        values = label if isinstance(label, list) else [label]
        if not isinstance(key, str) or not all(isinstance(v, str) for v in values):
            reader.refuse(f"{path}.labels.{key}", "must be a string or a list of strings")
    return metadata


def read_service(reader: Reader) -> None:
    body = reader.document.body
    read_metadata(reader, body["metadata"], "metadata", {"name"})
    # A Service's description is prose about the deployment; inferops writes its own.
    reader.mapping(body.get("spec") or {}, "spec", {"description"})


def read_slo(reader: Reader, by_kind: dict[str, dict[str, Document]]) -> dict:
    body = reader.document.body
    definition: dict[str, Any] = {"name": reader.document.name}
    metadata = read_metadata(reader, body["metadata"], "metadata", {"name", "annotations"})
    read_annotations(reader, metadata.get("annotations", {}), definition)
    spec = reader.mapping(body.get("spec"), "spec", {
        "description", "service", "indicator", "indicatorRef", "timeWindow", "budgetingMethod", "objectives",
        "alertPolicies"}, ("service", "budgetingMethod", "objectives"))
    if "description" in spec:
        definition["description"] = str(spec["description"] or "")
    service = spec.get("service")
    if not isinstance(service, str) or not service:
        if "service" in spec:
            reader.refuse("spec.service", "must name a deployment (or, for scope model, a model)")
    elif definition.get("scope") == Scope.MODEL:
        definition["model"] = service
    else:
        definition["deployment"] = service
    read_indicator(reader, spec, by_kind["SLI"], definition)
    read_time_window(reader, spec.get("timeWindow"), definition)
    read_budgeting(reader, spec, definition)
    if "alertPolicies" in spec and definition.get("sli_kind") == SliKind.QUALITY:
        reader.refuse("spec.alertPolicies", f"a quality SLO {QUALITY_ALERTING}: give none")
    elif "alertPolicies" in spec:
        read_alert_policies(reader, spec["alertPolicies"], definition, by_kind)
    return plain(definition)


def plain(values: dict) -> dict:
    """Choices as the plain strings they stand for (YAML and JSON write no enum members)."""
    return {key: value.value if isinstance(value, enum.Enum) else value for key, value in values.items()}


def read_annotations(reader: Reader, annotations: Any, definition: dict) -> None:
    if not isinstance(annotations, dict):
        reader.refuse("metadata.annotations", "must be a mapping")
        return
    for key, value in annotations.items():
        path = f"metadata.annotations.{key}"
        short = key[len(ANNOTATION_PREFIX):] if isinstance(key, str) and key.startswith(ANNOTATION_PREFIX) else None
        if short not in ANNOTATIONS:
            known = ", ".join(ANNOTATION_PREFIX + name for name in ANNOTATIONS)
            reader.refuse(path, f"not supported by inferops (it reads {known})")
            continue
        if short == "min-requests":
            if not str(value).isdigit():
                reader.refuse(path, "must be a whole number of events")
                continue
            definition["min_requests"] = int(value)
        elif short == "eval-every":
            seconds = int(value) if str(value).isdigit() else shorthand_seconds(value)
            if seconds is None:
                reader.refuse(path, "a duration such as 15m or 6h, or a number of seconds")
                continue
            definition["eval_every_s"] = seconds
        elif short == "alerting":
            if not isinstance(value, str):
                reader.refuse(path, "must be a string")  # prose: accepted, and written anew on export
        elif short == "scope" and value not in (Scope.MODEL, Scope.TENANT, Scope.DEPLOYMENT):
            reader.refuse(path, "one of deployment, model, tenant")
        elif ANNOTATIONS[short] is not None:
            definition[ANNOTATIONS[short]] = str(value)
    if definition.get("tenant") and "scope" not in definition:
        definition["scope"] = Scope.TENANT


def read_indicator(reader: Reader, spec: dict, slis: dict[str, Document], definition: dict) -> None:
    if ("indicator" in spec) == ("indicatorRef" in spec):
        reader.refuse("spec.indicator", "give exactly one of indicator and indicatorRef")
        return
    if "indicatorRef" in spec:
        target = slis.get(spec["indicatorRef"]) if isinstance(spec["indicatorRef"], str) else None
        if target is None:
            reader.refuse("spec.indicatorRef", f"no SLI document named {spec['indicatorRef']!r}")
            return
        # Problems inside a referenced SLI are reported against that document.
        sli_reader = Reader(target, reader.problems)
        read_metadata(sli_reader, target.body["metadata"], "metadata", {"name"})
        read_sli_spec(sli_reader, target.body.get("spec"), "spec", definition)
        return
    indicator = reader.mapping(spec["indicator"], "spec.indicator", {"metadata", "spec"}, ("spec",))
    read_metadata(reader, indicator.get("metadata", {}), "spec.indicator.metadata", {"name"})
    if "spec" in indicator:
        read_sli_spec(reader, indicator["spec"], "spec.indicator.spec", definition)


def read_sli_spec(reader: Reader, sli: Any, path: str, definition: dict) -> None:
    sli = reader.mapping(sli, path, {"description", "thresholdMetric", "ratioMetric"})
    if ("thresholdMetric" in sli) == ("ratioMetric" in sli):
        reader.refuse(path, "give exactly one of thresholdMetric and ratioMetric")
        return
    if "thresholdMetric" in sli:
        metric = reader.mapping(sli["thresholdMetric"], f"{path}.thresholdMetric", {"metricSource"}, ("metricSource",))
        source = read_source(reader, metric.get("metricSource"), f"{path}.thresholdMetric.metricSource")
        if source is None:
            return
        kind = source.pop("sli", None)
        if kind != SliKind.LATENCY:
            reader.refuse(f"{path}.thresholdMetric.metricSource.spec.sli",
                          "a thresholdMetric is a latency SLI (sli: latency); the other kinds are ratioMetrics")
            return
        definition["sli_kind"] = SliKind.LATENCY
        read_source_params(reader, source, f"{path}.thresholdMetric.metricSource.spec", set(LATENCY_KEYS), definition)
        return
    ratio_path = f"{path}.ratioMetric"
    ratio = reader.mapping(sli["ratioMetric"], ratio_path, {"counter", "good", "total"}, ("good", "total"))
    if "counter" in ratio:
        reader.expect(ratio["counter"], f"{ratio_path}.counter", True, "inferops counts events: counter is true")
    sources = {}
    for part in ("good", "total"):
        if part in ratio:
            holder = reader.mapping(ratio[part], f"{ratio_path}.{part}", {"metricSource"}, ("metricSource",))
            sources[part] = read_source(reader, holder.get("metricSource"), f"{ratio_path}.{part}.metricSource")
    if None in sources.values() or len(sources) < 2:
        return
    kinds = {part: source.pop("sli", None) for part, source in sources.items()}
    kind = kinds["total"]
    if kind not in (SliKind.AVAILABILITY, SliKind.GOODPUT, SliKind.RATIO, SliKind.QUALITY):
        reader.refuse(f"{ratio_path}.total.metricSource.spec.sli",
                      "a ratioMetric is an availability, goodput, ratio or quality SLI (latency is a thresholdMetric)")
        return
    if kinds["good"] != kind:
        reader.refuse(f"{ratio_path}.good.metricSource.spec.sli", f"must equal the total's sli ({kind})")
        return
    definition["sli_kind"] = kind
    good_path, total_path = f"{ratio_path}.good.metricSource.spec", f"{ratio_path}.total.metricSource.spec"
    if kind == SliKind.QUALITY:
        for part, spec_path in (("good", good_path), ("total", total_path)):
            if sources[part].pop("cases", None) != QUALITY_CASES[part]:
                reader.refuse(f"{spec_path}.cases", f"a quality SLI's {part} events are its eval cases "
                                                    f"{QUALITY_CASES[part]} (cases: {QUALITY_CASES[part]})")
            read_source_params(reader, sources[part], spec_path, set(), definition)
    elif kind == SliKind.RATIO:
        for part, spec_path, key in (("good", good_path, "ratio_good"), ("total", total_path, "ratio_total")):
            series = sources[part].pop("series", None)
            if series not in RATIO_SERIES:
                reader.refuse(f"{spec_path}.series", f"name one of the scraped series {', '.join(RATIO_SERIES)}")
            else:
                definition[key] = series
            read_source_params(reader, sources[part], spec_path, set(), definition)
    else:
        good_keys = set(LATENCY_KEYS) if kind == SliKind.GOODPUT else set()
        read_source_params(reader, sources["good"], good_path, good_keys, definition)
        read_source_params(reader, sources["total"], total_path, set(), definition)


def read_source(reader: Reader, source: Any, path: str) -> dict | None:
    """A copy of an inferops metric source's spec, or None (refused)."""
    source = reader.mapping(source, path, {"type", "spec"}, ("type", "spec"))
    if source.get("type") != SOURCE_TYPE:
        if "type" in source:
            reader.refuse(f"{path}.type", f'only "{SOURCE_TYPE}" is supported')
        return None
    if not isinstance(source.get("spec"), dict):
        reader.refuse(f"{path}.spec", "must be a mapping naming the SLI (sli: availability|latency|goodput|ratio)")
        return None
    return dict(source["spec"])


def read_source_params(reader: Reader, params: dict, path: str, allowed: set[str], definition: dict) -> None:
    for key, value in params.items():
        if key not in allowed:
            reader.refuse(f"{path}.{key}", "not supported by inferops")
        elif isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            reader.refuse(f"{path}.{key}", "a threshold in milliseconds, above 0")
        else:
            definition[LATENCY_KEYS[key]] = float(value)


def read_time_window(reader: Reader, windows: Any, definition: dict) -> None:
    if windows is None:
        reader.refuse("spec.timeWindow", "required: inferops keeps budgets over a rolling or calendar window")
        return
    if not isinstance(windows, list) or len(windows) != 1:
        reader.refuse("spec.timeWindow", "exactly one time window")
        return
    path = "spec.timeWindow[0]"
    window = reader.mapping(windows[0], path, {"duration", "isRolling", "calendar"}, ("duration",))
    duration = window.get("duration")
    if "calendar" not in window:
        reader.expect(window.get("isRolling"), f"{path}.isRolling", True, "true for a rolling window")
        seconds = shorthand_seconds(duration)
        matches = [w for w, days in ROLLING_DAYS.items() if days * DAY == seconds]
        if not matches:
            reader.refuse(f"{path}.duration", "a rolling window lasts 1d, 7d, 28d or 30d")
        else:
            definition["window"] = matches[0]
        return
    if window.get("isRolling", False) is not False:
        reader.refuse(f"{path}.isRolling", "false (or absent) for a calendar window")
    if duration not in CALENDAR_WINDOWS:
        reader.refuse(f"{path}.duration", "a calendar window lasts 1w or 1M")
        return
    definition["window"] = CALENDAR_WINDOWS[duration]
    calendar = reader.mapping(window["calendar"], f"{path}.calendar", {"startTime", "timeZone"},
                              ("startTime", "timeZone"))
    zone = calendar.get("timeZone")
    try:
        zoneinfo.ZoneInfo(zone)
        definition["time_zone"] = zone
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        reader.refuse(f"{path}.calendar.timeZone", "an IANA time zone name, e.g. Europe/Berlin")
    if "startTime" in calendar:
        start = calendar_start(calendar["startTime"])
        weekly = duration == "1w"
        aligned = start is not None and start.time() == datetime.min.time() and (
            start.weekday() == 0 if weekly else start.day == 1)
        if not aligned:
            where = "a Monday" if weekly else "the first day of a month"
            reader.refuse(f"{path}.calendar.startTime", f"inferops' calendar windows start at 00:00 on {where}")


def calendar_start(value: Any) -> datetime | None:
    # YAML reads an unquoted "2024-01-01 00:00:00" as a datetime already.
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def read_budgeting(reader: Reader, spec: dict, definition: dict) -> None:
    method = spec.get("budgetingMethod")
    methods = {"Occurrences": Budgeting.OCCURRENCES, "Timeslices": Budgeting.TIMESLICES}
    if "budgetingMethod" in spec and method not in methods:
        reader.refuse("spec.budgetingMethod", "Occurrences or Timeslices")
    definition["budgeting"] = methods.get(method, Budgeting.OCCURRENCES)
    objectives = spec.get("objectives")
    if objectives is None:
        return
    if not isinstance(objectives, list) or not objectives:
        reader.refuse("spec.objectives", "a list with one objective")
        return
    for index in range(1, len(objectives)):
        reader.refuse(f"spec.objectives[{index}]", "only one objective is supported")
    path = "spec.objectives[0]"
    objective = reader.mapping(objectives[0], path, {"target", "targetPercent", "timeSliceTarget", "timeSliceWindow"})
    if ("target" in objective) == ("targetPercent" in objective):
        reader.refuse(path, "give exactly one of target and targetPercent")
    elif not isinstance(objective.get("target", objective.get("targetPercent")), int | float):
        reader.refuse(f"{path}.{'target' if 'target' in objective else 'targetPercent'}", "must be a number")
    else:
        definition["objective"] = (float(objective["target"]) if "target" in objective
                                   else round(float(objective["targetPercent"]) / 100, 12))
    if definition["budgeting"] == Budgeting.TIMESLICES:
        if objective.get("timeSliceWindow") not in (TIMESLICE_WINDOW, 1):
            reader.refuse(f"{path}.timeSliceWindow", f"inferops' time slices last one minute ({TIMESLICE_WINDOW})")
        target = objective.get("timeSliceTarget")
        if isinstance(target, bool) or not isinstance(target, int | float):
            reader.refuse(f"{path}.timeSliceTarget", "Timeslices budgeting needs a timeSliceTarget in (0, 1]")
        else:
            definition["timeslice_target"] = float(target)
    else:
        for key in ("timeSliceTarget", "timeSliceWindow"):
            if key in objective:
                reader.refuse(f"{path}.{key}", "applies only to Timeslices budgeting")


def read_alert_policies(reader: Reader, policies: Any, definition: dict, by_kind: dict) -> None:
    """Check that the policies describe exactly inferops' standard burn-rate alerts for the window."""
    if not isinstance(policies, list):
        reader.refuse("spec.alertPolicies", "must be a list")
        return
    found: list[tuple[Reader, str, tuple]] = []
    for index, item in enumerate(policies):
        path = f"spec.alertPolicies[{index}]"
        if isinstance(item, dict) and "alertPolicyRef" in item:
            reader.mapping(item, path, {"alertPolicyRef"})
            target = by_kind["AlertPolicy"].get(item["alertPolicyRef"])
            if target is None:
                reader.refuse(f"{path}.alertPolicyRef", f"no AlertPolicy document named {item['alertPolicyRef']!r}")
                continue
            policy_reader = Reader(target, reader.problems)
            policy_reader.mapping(target.body["metadata"], "metadata", {"name"})
            read_alert_policy(policy_reader, target.body.get("spec"), "spec", by_kind, found)
            continue
        item = reader.mapping(item, path, {"kind", "metadata", "spec"}, ("kind", "spec"))
        reader.expect(item.get("kind"), f"{path}.kind", "AlertPolicy", "an inline policy has kind AlertPolicy")
        reader.mapping(item.get("metadata", {}), f"{path}.metadata", {"name"})
        read_alert_policy(reader, item.get("spec"), f"{path}.spec", by_kind, found)
    if "window" not in definition:
        return
    rules = alert_rules(definition["window"])
    expected = {(rule.severity, rule.factor, rule.long_minutes * 60, rule.short_minutes * 60) for rule in rules}
    table = ", ".join(f"{rule.severity} {rule.factor:g}x over {duration_shorthand(rule.long_minutes * 60)} and "
                      f"{duration_shorthand(rule.short_minutes * 60)}" for rule in rules)
    seen = set()
    for condition_reader, path, condition in found:
        if condition not in expected:
            condition_reader.refuse(path, f"inferops alerts with the standard multiwindow set for this window "
                                          f"({table}); this condition is not one of them")
        elif condition in seen:
            condition_reader.refuse(path, "the same condition twice")
        seen.add(condition)
    if found and not expected <= seen:
        missing = sorted(expected - seen, key=lambda c: -c[1])
        reader.refuse("spec.alertPolicies", "inferops always raises the whole standard set; missing: "
                      + ", ".join(f"{c[0]} {c[1]:g}x" for c in missing))


def read_alert_policy(reader: Reader, spec: Any, path: str, by_kind: dict, found: list) -> None:
    spec = reader.mapping(spec, path, {"description", "alertWhenNoData", "alertWhenResolved", "alertWhenBreaching",
                                       "conditions"}, ("conditions",))
    for key, wanted in (("alertWhenBreaching", True), ("alertWhenResolved", True), ("alertWhenNoData", False)):
        if key in spec:
            reader.expect(spec[key], f"{path}.{key}", wanted, f"inferops' burn-rate alerts have {key}: "
                                                              f"{str(wanted).lower()}")
    conditions = spec.get("conditions")
    if "conditions" in spec and (not isinstance(conditions, list) or not conditions):
        reader.refuse(f"{path}.conditions", "a list of burnrate conditions")
        return
    for index, item in enumerate(conditions or []):
        item_path = f"{path}.conditions[{index}]"
        if isinstance(item, dict) and "conditionRef" in item:
            reader.mapping(item, item_path, {"conditionRef"})
            target = by_kind["AlertCondition"].get(item["conditionRef"])
            if target is None:
                reader.refuse(f"{item_path}.conditionRef", f"no AlertCondition document named {item['conditionRef']!r}")
                continue
            condition_reader = Reader(target, reader.problems)
            condition_reader.mapping(target.body["metadata"], "metadata", {"name"})
            read_condition(condition_reader, target.body.get("spec"), "spec", found)
            continue
        item = reader.mapping(item, item_path, {"kind", "metadata", "spec"}, ("kind", "spec"))
        reader.expect(item.get("kind"), f"{item_path}.kind", "AlertCondition",
                      "an inline condition has kind AlertCondition")
        reader.mapping(item.get("metadata", {}), f"{item_path}.metadata", {"name"})
        read_condition(reader, item.get("spec"), f"{item_path}.spec", found)


def read_condition(reader: Reader, spec: Any, path: str, found: list) -> None:
    spec = reader.mapping(spec, path, {"description", "severity", "condition"}, ("severity", "condition"))
    if "severity" in spec and spec["severity"] not in ("page", "ticket"):
        reader.refuse(f"{path}.severity", "page or ticket")
    condition = reader.mapping(spec.get("condition", {}), f"{path}.condition",
                               {"kind", "op", "threshold", "lookbackWindow", "alertAfter"},
                               ("kind", "threshold", "lookbackWindow", "alertAfter"))
    reader.expect(condition.get("kind"), f"{path}.condition.kind", "burnrate", "only burnrate conditions are supported")
    if "op" in condition:
        reader.expect(condition["op"], f"{path}.condition.op", "gte", "inferops alerts when the burn rate reaches "
                                                                        "the threshold (gte)")
    long_s = shorthand_seconds(condition.get("lookbackWindow"))
    short_s = shorthand_seconds(condition.get("alertAfter"))
    for key, seconds in (("lookbackWindow", long_s), ("alertAfter", short_s)):
        if key in condition and seconds is None:
            reader.refuse(f"{path}.condition.{key}", "a duration such as 5m, 1h or 3d")
    threshold = condition.get("threshold")
    if "threshold" in condition and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
        reader.refuse(f"{path}.condition.threshold", "must be a number")
        return
    if None not in (long_s, short_s, threshold) and spec.get("severity") in ("page", "ticket"):
        found.append((reader, f"{path}.condition", (spec["severity"], float(threshold), long_s, short_s)))


# --- export -----------------------------------------------------------------------------------


def documents_from_definition(definition: dict) -> list[dict]:
    """The Service and SLO documents of one SLO definition (the shape `definitions_from_documents` reads)."""
    definition = plain(definition)
    name = definition["name"]
    scope = definition.get("scope") or Scope.DEPLOYMENT.value
    service = definition["model"] if scope == Scope.MODEL else definition["deployment"]
    what = "model" if scope == Scope.MODEL else "deployment"
    service_doc = {"apiVersion": API_VERSION, "kind": "Service", "metadata": {"name": service},
                   "spec": {"description": f"inferops {what} {service}"}}
    metadata: dict[str, Any] = {"name": name}
    annotations = slo_annotations(definition, scope)
    if annotations:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {}
    if definition.get("description"):
        spec["description"] = definition["description"]
    spec["service"] = service
    spec["indicator"] = {"metadata": {"name": f"{name}-sli"}, "spec": sli_spec(definition)}
    spec["timeWindow"] = [time_window(definition)]
    timeslices = definition.get("budgeting") == Budgeting.TIMESLICES
    spec["budgetingMethod"] = "Timeslices" if timeslices else "Occurrences"
    objective: dict[str, Any] = {"target": definition["objective"]}
    if timeslices:
        objective["timeSliceTarget"] = definition["timeslice_target"]
        objective["timeSliceWindow"] = TIMESLICE_WINDOW
    spec["objectives"] = [objective]
    if definition["sli_kind"] != SliKind.QUALITY:
        spec["alertPolicies"] = [alert_policy(name, definition["window"])]
    return [service_doc, {"apiVersion": API_VERSION, "kind": "SLO", "metadata": metadata, "spec": spec}]


def slo_annotations(definition: dict, scope: str) -> dict[str, str]:
    annotations = {}
    if scope != Scope.DEPLOYMENT:
        annotations["scope"] = scope
    for key in ("tenant", "owner", "runbook_url"):
        if definition.get(key):
            annotations[key.replace("_", "-")] = definition[key]
    if definition.get("min_requests", DEFAULT_MIN_REQUESTS) != DEFAULT_MIN_REQUESTS:
        annotations["min-requests"] = str(definition["min_requests"])
    if definition["sli_kind"] == SliKind.QUALITY:
        annotations["eval-set"] = definition["eval_set"]
        every = definition["eval_every_s"]
        annotations["eval-every"] = duration_shorthand(every) if every % 60 == 0 else str(every)
        annotations["alerting"] = QUALITY_ALERTING
    return {ANNOTATION_PREFIX + key: value for key, value in annotations.items()}


def inferops_source(spec: dict) -> dict:
    return {"metricSource": {"type": SOURCE_TYPE, "spec": spec}}


def sli_spec(definition: dict) -> dict:
    kind = definition["sli_kind"]
    thresholds = {key: definition[field_name] for key, field_name in LATENCY_KEYS.items()
                  if definition.get(field_name) is not None}
    if kind == SliKind.LATENCY:
        return {"thresholdMetric": inferops_source({"sli": kind, **thresholds})}
    good: dict[str, Any] = {"sli": kind}
    total: dict[str, Any] = {"sli": kind}
    if kind == SliKind.GOODPUT:
        good.update(thresholds)
    elif kind == SliKind.RATIO:
        good["series"] = definition["ratio_good"]
        total["series"] = definition["ratio_total"]
    elif kind == SliKind.QUALITY:
        good["cases"], total["cases"] = QUALITY_CASES["good"], QUALITY_CASES["total"]
    return {"ratioMetric": {"counter": True, "good": inferops_source(good), "total": inferops_source(total)}}


def time_window(definition: dict) -> dict:
    window = definition["window"]
    for duration, value in CALENDAR_WINDOWS.items():
        if value == window:
            return {"duration": duration, "calendar": {"startTime": CALENDAR_ANCHOR,
                                                       "timeZone": definition.get("time_zone") or "UTC"},
                    "isRolling": False}
    return {"duration": str(window), "isRolling": True}


def alert_policy(name: str, window: str) -> dict:
    conditions = []
    for rule in alert_rules(window):
        pace = "slow" if any(c["spec"]["severity"] == rule.severity for c in conditions) else "fast"
        conditions.append({
            "kind": "AlertCondition",
            "metadata": {"name": f"{name}-{rule.severity}-{pace}"},
            "spec": {"severity": rule.severity, "condition": {
                "kind": "burnrate", "op": "gte", "threshold": rule.factor,
                "lookbackWindow": duration_shorthand(rule.long_minutes * 60),
                "alertAfter": duration_shorthand(rule.short_minutes * 60)}},
        })
    return {"kind": "AlertPolicy", "metadata": {"name": f"{name}-burn-rate"},
            "spec": {"alertWhenBreaching": True, "alertWhenResolved": True, "alertWhenNoData": False,
                     "conditions": conditions}}


def dump_documents(documents: list[dict]) -> str:
    """A YAML stream; one Service document per service even when several SLOs share it."""
    seen: set[tuple] = set()
    unique = []
    for doc in documents:
        key = (doc["kind"], doc["metadata"]["name"])
        if doc["kind"] == "Service" and key in seen:
            continue
        seen.add(key)
        unique.append(doc)
    return yaml.safe_dump_all(unique, sort_keys=False, allow_unicode=True, default_flow_style=False)


# --- the database side: import through the core's services, export from rows -------------------


def definition_from_slo(slo) -> dict:
    """The fields of an Slo row that OpenSLO carries, with deployment and model as names."""
    definition = {
        "name": slo.name, "description": slo.description, "owner": slo.owner, "runbook_url": slo.runbook_url,
        "scope": slo.scope, "tenant": slo.tenant, "sli_kind": slo.sli_kind, "objective": slo.objective,
        "window": slo.window, "time_zone": slo.time_zone, "budgeting": slo.budgeting,
        "timeslice_target": slo.timeslice_target, "min_requests": slo.min_requests,
        "ratio_good": slo.ratio_good, "ratio_total": slo.ratio_total,
        "deployment": slo.deployment.name if slo.deployment_id else None,
        "model": slo.model.name if slo.model_id else None,
        "eval_set": slo.eval_set.name if slo.eval_set_id else None, "eval_every_s": slo.eval_every_s,
    }
    for field_name in LATENCY_KEYS.values():
        definition[field_name] = getattr(slo, field_name)
    return definition


def export_slos(slos) -> str:
    documents: list[dict] = []
    for slo in slos:
        documents.extend(documents_from_definition(definition_from_slo(slo)))
    return dump_documents(documents)


def import_text(text: str, *, actor) -> list:
    """Create every SLO of an OpenSLO YAML stream in one transaction, or none.

    Raises ValueError for malformed YAML, OpenSloRefused for unsupported fields or services that
    name no deployment (or model), and Django's ValidationError (prefixed with the SLO's name) for
    values the SLO model refuses.
    """
    from django.core.exceptions import ValidationError
    from django.db import transaction

    from deployments.models import Deployment
    from evals.models import EvalSet
    from registry.models import RegisteredModel
    from slo.services import slo_create

    indexed = read_documents(parse_documents(text))
    definitions = [definition for _, definition in indexed]
    problems = []
    for index, definition in indexed:
        for key, model in (("deployment", Deployment), ("model", RegisteredModel)):
            name = definition.get(key)
            if name is None:
                continue
            rows = model.objects.filter(deleted_at=None) if model is Deployment else model.objects.all()
            definition[key] = rows.filter(name=name).first()
            if definition[key] is None:
                hint = ""
                if key == "deployment" and RegisteredModel.objects.filter(name=name).exists():
                    hint = f" ({name!r} is a model: annotate the SLO with {ANNOTATION_PREFIX}scope: model)"
                problems.append(Problem(index, "SLO", definition["name"], "spec.service",
                                        f"no {key} named {name!r} in inferops{hint}"))
        if (name := definition.get("eval_set")) is not None:
            definition["eval_set"] = EvalSet.objects.filter(name=name).first()
            if definition["eval_set"] is None:
                problems.append(Problem(index, "SLO", definition["name"],
                                        f"metadata.annotations.{ANNOTATION_PREFIX}eval-set",
                                        f"no eval set named {name!r} in inferops"))
    if problems:
        raise OpenSloRefused(problems)
    created = []
    with transaction.atomic():
        for definition in definitions:
            try:
                created.append(slo_create(actor=actor, **definition))
            except ValidationError as exc:
                detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
                raise ValidationError({f"{definition['name']}.{key}": messages
                                       for key, messages in detail.items()}) from None
    return created
