"""Alert grouping benchmark: 1,000 alerts in one minute, deduplicated, grouped and notified,
against Prometheus Alertmanager 0.25 in the same run (issue 29's figure).

Both systems run for real, side by side, and get the same schedule of POSTs:

- inferops: the web app under uvicorn (as `inferops run` starts it: `python -m uvicorn
  project.asgi:application --no-access-log`) and one Celery worker with its embedded beat
  (`celery -A inferops.celery worker --beat --concurrency 2`, as tests/deployments/
  test_worker_e2e.py starts it), on a scratch database and the Redis database of REDIS_URL.
  One route under the default route (matcher bench="alerts", group_by ["group"], group_wait_s
  30, group_interval_s 300, repeat_interval_s 14400) sends to a webhook receiver; alerts come in
  through `POST /api/v1/alerts/alertmanager/` (Alertmanager's webhook payload v4) with an
  integration's bearer token.
- Alertmanager: the Debian package `prometheus-alertmanager` (0.25), clustering off, with a
  config written here (the same group_by, group_wait 30s, group_interval 5m, repeat_interval
  4h, one webhook receiver); alerts come in through `POST /api/v2/alerts`.

Each system's webhook goes to its own HTTP recorder in this process, which timestamps every
notification on arrival.

The load, as Prometheus sends it: one rule evaluation every 5 s. 1,000 alerts in 50 groups
(label `group`, 20 alerts each, label `instance`): group g starts firing at evaluation
g * 12 // 50 (0-55 s), half its alerts then, the other half at the next evaluation (5 s later);
every firing alert is sent again at the next two evaluations (Prometheus re-sends active
alerts), so most alerts are posted three times and every one at least twice; new alerts arrive
over 0-60 s, re-sends until 70 s. Each evaluation's alerts go in POSTs of at most 64 alerts
(Prometheus' batch size), in the same order, to both systems at the same moment (one sender
thread per system, so a slow system delays only its own later POSTs). Then it waits group_wait
+ 30 s after the last POST and counts what arrived.

Run from the repository root (needs a Postgres where it may create and drop a scratch database,
an empty Redis database, and `apt-get install prometheus-alertmanager`):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/9 \\
        INFEROPS_DATA_DIR=/tmp/inferops-bench-alerts .venv/bin/python bench/alerts/bench_alerts.py

Results go to bench/alerts/results-<date>.json (see bench/alerts/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from scratch import (  # noqa: E402
    django_on_scratch_database,
    free_port,
    log,
    percentile,
    recreate_scratch_database,
    scratch_database_url,
    wait_for,
)

SCRATCH_DB = "inferops_bench_alerts"
GROUPS = 50
PER_GROUP = 20
EVAL_S = 5.0
FIRST_TICKS = 12  # groups start at evaluations 0..11 (0-55 s)
RESENDS = 2  # each firing alert is sent again at the next two evaluations
BATCH = 64  # Prometheus' maxBatchSize
GROUP_WAIT_S, GROUP_INTERVAL_S, REPEAT_INTERVAL_S = 30, 300, 14400
TARGET_S = GROUP_WAIT_S + 10
SETTLE_S = GROUP_WAIT_S + 30
GO_ZERO = "0001-01-01T00:00:00Z"

ALERTMANAGER_CONFIG = """\
# Written by bench/alerts/bench_alerts.py: the same route as inferops' in this benchmark.
route:
  receiver: recorder
  group_by: [group]
  group_wait: {group_wait}s
  group_interval: {group_interval}s
  repeat_interval: {repeat_interval}s
receivers:
  - name: recorder
    webhook_configs:
      - url: http://127.0.0.1:{port}/alertmanager
        send_resolved: true
"""


def iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------- machine load


STEAL = 7  # /proc/stat cpu fields: user nice system idle iowait irq softirq steal


def cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(v) for v in stat.readline().split()[1:]]


class CpuSampler(threading.Thread):
    """Every second: load average and the share of CPU time stolen and busy, for the run's record."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[dict] = []
        self.stopping = threading.Event()
        self.first = cpu_times()

    def run(self) -> None:
        previous, start = cpu_times(), time.time()
        while not self.stopping.wait(1.0):
            now = cpu_times()
            delta = [a - b for a, b in zip(now[:STEAL + 1], previous[:STEAL + 1], strict=True)]
            total = sum(delta) or 1
            self.samples.append({"t": round(time.time() - start, 1), "load_1m": round(os.getloadavg()[0], 2),
                                 "busy": round((total - delta[3] - delta[4]) / total, 3),
                                 "steal": round(delta[STEAL] / total, 3)})
            previous = now

    def summary(self) -> dict:
        last = cpu_times()
        delta = [a - b for a, b in zip(last[:STEAL + 1], self.first[:STEAL + 1], strict=True)]
        total = sum(delta) or 1
        loads = [s["load_1m"] for s in self.samples]
        return {"cpu_steal_share": round(delta[STEAL] / total, 4),
                "cpu_busy_share": round((total - delta[3] - delta[4]) / total, 3),
                "load_average_1m_min": min(loads, default=None), "load_average_1m_max": max(loads, default=None)}


# ---------------------------------------------------------------------------- the recorders


class Recorder:
    """A local webhook endpoint: every POST's arrival time and JSON body."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[dict] = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                arrived = time.time()
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsed": body[:200].decode(errors="replace")}
                with recorder.lock:
                    recorder.received.append({"at": arrived, "path": self.path, "payload": payload})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------- the schedule


def alert_labels(group: int, instance: int) -> dict[str, str]:
    return {"alertname": "BenchReplicaDown", "bench": "alerts", "group": f"g{group:02d}",
            "instance": f"replica-{instance:02d}", "severity": "warning"}


def schedule() -> list[list[tuple[int, int]]]:
    """Per evaluation, the (group, instance) pairs sent then, in order: new ones and re-sends."""
    first_tick = {}
    for group in range(GROUPS):
        start = group * FIRST_TICKS // GROUPS
        for instance in range(PER_GROUP):
            first_tick[(group, instance)] = start + (0 if instance < PER_GROUP // 2 else 1)
    last = max(first_tick.values()) + RESENDS
    return [[pair for pair, first in sorted(first_tick.items()) if first <= tick <= first + RESENDS]
            for tick in range(last + 1)]


class Sender(threading.Thread):
    """Sends one system its POSTs at the evaluation times (or as soon as its previous POST is done)."""

    def __init__(self, name: str, url: str, headers: dict, body, ticks, t0: float, fired_at: dict):
        super().__init__(daemon=True)
        self.name, self.url, self.headers, self.body = name, url, headers, body
        self.ticks, self.t0, self.fired_at = ticks, t0, fired_at
        self.posts: list[dict] = []

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=120) as client:
            for index, pairs in enumerate(self.ticks):
                due = self.t0 + index * EVAL_S
                time.sleep(max(0.0, due - time.time()))
                for start in range(0, len(pairs), BATCH):
                    batch = pairs[start:start + BATCH]
                    sent = time.time()
                    try:
                        response = client.post(self.url, headers=self.headers, json=self.body(batch, sent,
                                                                                              self.fired_at))
                        status, answer = response.status_code, response.text[:500]
                    except Exception as exc:  # noqa: BLE001 - recorded, counted as failed
                        status, answer = None, repr(exc)
                    self.posts.append({"tick": index, "sent": sent, "done": time.time(), "alerts": batch,
                                       "status": status, "answer": answer})


def inferops_body(batch, sent, fired_at) -> dict:
    return {"version": "4", "status": "firing", "receiver": "prometheus", "groupKey": "{}", "groupLabels": {},
            "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://prometheus.bench.local",
            "alerts": [{"status": "firing", "labels": alert_labels(*pair),
                        "annotations": {"summary": f"replica {pair[1]} of g{pair[0]:02d} is down"},
                        "startsAt": iso(fired_at[pair]), "endsAt": GO_ZERO,
                        "generatorURL": "http://prometheus.bench.local/graph?g0.expr=up%3D%3D0"}
                       for pair in batch]}


def alertmanager_body(batch, sent, fired_at) -> list:
    # Prometheus sends endsAt = now + 4 x max(resend delay 1m, evaluation interval).
    return [{"labels": alert_labels(*pair),
             "annotations": {"summary": f"replica {pair[1]} of g{pair[0]:02d} is down"},
             "startsAt": iso(fired_at[pair]), "endsAt": iso(sent + 240),
             "generatorURL": "http://prometheus.bench.local/graph?g0.expr=up%3D%3D0"} for pair in batch]


# ---------------------------------------------------------------------------- the two systems


class Processes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        logfile = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=logfile, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.started.append((name, process))
        return process

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]

    def stop_all(self) -> None:
        for _, process in reversed(self.started):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, process in reversed(self.started):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def setup_inferops(recorder: Recorder) -> tuple[str, dict]:
    """The route, its webhook receiver and an integration, through the services and the ORM."""
    from alerts.inbound.alertmanager import integration_create
    from alerts.models import Receiver, Route
    from alerts.routing.dispatch import default_route

    receiver = Receiver.objects.create(name="bench-recorder", kind="webhook",
                                       url=f"http://127.0.0.1:{recorder.port}/inferops")
    route = Route.objects.create(parent=default_route(), position=0,
                                 matchers=[{"name": "bench", "value": "alerts", "op": "="}], receiver=receiver,
                                 group_by=["group"], group_wait_s=GROUP_WAIT_S, group_interval_s=GROUP_INTERVAL_S,
                                 repeat_interval_s=REPEAT_INTERVAL_S)
    _, token = integration_create(name="bench-prometheus", actor=None)
    return token, {"route": route.pk, "receiver": receiver.pk, "group_by": route.group_by,
                   "group_wait_s": route.group_wait_s, "group_interval_s": route.group_interval_s,
                   "repeat_interval_s": route.repeat_interval_s}


def inferops_state() -> dict:
    """What the database says, and where each group's delay went: group made (first alert
    ingested) -> flushed by a beat tick (`last_flushed_at`) -> delivered (the notification's
    `finished_at`, after the recorder answered)."""
    from django.db.models import Count, Min

    from alerts.models import Alert, AlertGroup, Delivery, Notification

    waits, deliveries = [], []
    for group in AlertGroup.objects.annotate(delivered=Min("notifications__finished_at")):
        if group.last_flushed_at:
            waits.append((group.last_flushed_at - group.created_at).total_seconds())
            if group.delivered:
                deliveries.append((group.delivered - group.last_flushed_at).total_seconds())
    return {"group_created_to_flushed_s": {"min": round(min(waits), 3), "p50": round(percentile(waits, 50), 3),
                                           "max": round(max(waits), 3)} if waits else None,
            "flushed_to_delivered_s": {"min": round(min(deliveries), 3),
                                       "p50": round(percentile(deliveries, 50), 3),
                                       "max": round(max(deliveries), 3)} if deliveries else None,
            "alerts": Alert.objects.count(), "open_alerts": Alert.objects.filter(status="firing").count(),
            "groups": AlertGroup.objects.count(),
            "groups_notified": AlertGroup.objects.filter(first_notified_at__isnull=False).count(),
            "notifications_by_status": dict(Notification.objects.values_list("status").annotate(n=Count("id"))),
            "notification_rows": Notification.objects.count(),
            "deliveries": Delivery.objects.count(),
            "delivery_batches": Notification.objects.values("batch").distinct().count()}


def alertmanager_state(base: str) -> dict:
    import httpx

    alerts = httpx.get(f"{base}/api/v2/alerts", timeout=30).json()
    groups = httpx.get(f"{base}/api/v2/alerts/groups", timeout=30).json()
    metrics = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(("alertmanager_notifications_total{", "alertmanager_notifications_failed_total{",
                            "alertmanager_alerts_received_total", "alertmanager_alerts_invalid_total")):
            name, value = line.rsplit(" ", 1)
            if "integration=" not in name or 'integration="webhook"' in name:
                metrics[name] = float(value)
    return {"alerts": len(alerts), "groups": len(groups), "metrics": metrics}


# ---------------------------------------------------------------------------- analysis


def analyse(recorder: Recorder, sender: Sender, fired_at: dict, t0: float, end_of_load: float) -> dict:
    first_sent: dict[str, float] = {}
    first_done: dict[str, float] = {}
    for post in sender.posts:
        for group, _ in post["alerts"]:
            key = f"g{group:02d}"
            first_sent.setdefault(key, post["sent"])
            first_done.setdefault(key, post["done"])
    notifications = sorted(recorder.received, key=lambda r: r["at"])
    per_group: dict[str, list[dict]] = {}
    seen: dict[tuple[str, str], int] = {}
    firing = resolved = 0
    for note in notifications:
        payload = note["payload"]
        alerts = payload.get("alerts", [])
        if payload.get("status") == "resolved":
            resolved += 1
        else:
            firing += 1
        groups = {a["labels"].get("group") for a in alerts}
        group = groups.pop() if len(groups) == 1 else f"mixed:{sorted(g for g in groups if g)}"
        per_group.setdefault(group, []).append({"at": note["at"], "alerts": len(alerts),
                                                "firing": sum(a.get("status") == "firing" for a in alerts)})
        for alert in alerts:
            if alert.get("status") == "firing":
                pair = (alert["labels"].get("group"), alert["labels"].get("instance"))
                seen[pair] = seen.get(pair, 0) + 1
    expected = {(f"g{g:02d}", f"replica-{i:02d}") for g, i in fired_at}
    delays, delays_from_accepted, rows = [], [], {}
    for group in sorted(first_sent):
        notes = per_group.get(group, [])
        row = {"first_alert_sent_s": round(first_sent[group] - t0, 3), "notifications": len(notes),
               "alerts_per_notification": [n["alerts"] for n in notes],
               "arrived_s": [round(n["at"] - t0, 3) for n in notes]}
        if notes:
            row["delay_s"] = round(notes[0]["at"] - first_sent[group], 3)
            delays.append(notes[0]["at"] - first_sent[group])
            delays_from_accepted.append(notes[0]["at"] - first_done[group])
        rows[group] = row
    duplicates = sum(count - 1 for count in seen.values() if count > 1)
    late = [n for group in per_group for n in per_group[group][1:]]

    def stats(values):
        return {"p50": round(percentile(values, 50), 3) if values else None,
                "p99": round(percentile(values, 99), 3) if values else None,
                "max": round(max(values), 3) if values else None,
                "min": round(min(values), 3) if values else None}

    statuses: dict[str, int] = {}
    for post in sender.posts:
        statuses[str(post["status"])] = statuses.get(str(post["status"]), 0) + 1
    post_s = [post["done"] - post["sent"] for post in sender.posts]
    return {
        "posts": len(sender.posts), "post_statuses": statuses,
        "alerts_posted": sum(len(p["alerts"]) for p in sender.posts),
        "post_seconds": {"p50": round(statistics.median(post_s), 3), "max": round(max(post_s), 3),
                         "sum": round(sum(post_s), 1)},
        "alerts_per_post_second": round(sum(len(p["alerts"]) for p in sender.posts) / sum(post_s)),
        "last_post_done_s": round(max(p["done"] for p in sender.posts) - t0, 3),
        "notifications": len(notifications), "firing_notifications": firing, "resolved_notifications": resolved,
        "groups_notified": sum(1 for g in first_sent if per_group.get(g)),
        "groups_notified_more_than_once": sum(1 for g in per_group if len(per_group[g]) > 1),
        "notifications_after_the_first_of_their_group": len(late),
        "alerts_notified": len(set(seen) & expected), "alerts_missing": len(expected - set(seen)),
        "alerts_notified_twice_or_more": sum(1 for c in seen.values() if c > 1), "duplicate_alert_mentions": duplicates,
        "unexpected_alerts": len(set(seen) - expected),
        "delay_from_first_alert_sent_s": stats(delays),
        "delay_from_first_alert_accepted_s": stats(delays_from_accepted),
        "groups_within_target": sum(1 for d in delays if d <= TARGET_S),
        "groups": rows,
        "last_notification_s": round(notifications[-1]["at"] - t0, 3) if notifications else None,
        "waited_after_last_post_s": round(end_of_load - max(p["done"] for p in sender.posts), 1),
    }


def verdict(result: dict) -> dict:
    return {"one_notification_per_group": result["firing_notifications"] == GROUPS
            and result["groups_notified"] == GROUPS and result["groups_notified_more_than_once"] == 0,
            "every_alert_exactly_once": result["alerts_missing"] == 0 and result["duplicate_alert_mentions"] == 0,
            "max_delay_within_group_wait_plus_10s": (result["delay_from_first_alert_sent_s"]["max"] or 1e9)
            <= TARGET_S}


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default=SCRATCH_DB)
    parser.add_argument("--alertmanager", default=shutil.which("prometheus-alertmanager") or "prometheus-alertmanager")
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    args = parser.parse_args()

    import redis

    redis_url = os.environ.get("REDIS_URL", "")
    store = redis.Redis.from_url(redis_url) if redis_url else None
    if store is None or store.dbsize():
        sys.exit(f"REDIS_URL must name an empty Redis database ({redis_url!r} has keys or is unset)")
    if not os.path.exists(args.alertmanager):
        sys.exit("prometheus-alertmanager not found: apt-get install -y prometheus-alertmanager")
    version = subprocess.run([args.alertmanager, "--version"], capture_output=True, text=True).stdout.splitlines()
    os.environ.setdefault("INFEROPS_DATA_DIR", tempfile.mkdtemp(prefix="inferops-bench-alerts-data-"))

    admin_url = django_on_scratch_database(args.database)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", interactive=False, verbosity=0)
    workdir = Path(tempfile.mkdtemp(prefix="bench-alerts-"))
    processes = Processes(workdir)
    recorders = {"inferops": Recorder("inferops"), "alertmanager": Recorder("alertmanager")}
    sampler = CpuSampler()
    result: dict = {"date": datetime.now(UTC).date().isoformat(), "started": datetime.now(UTC).isoformat(),
                    "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "alertmanager_version": version[0] if version else None,
                    "load": {"groups": GROUPS, "alerts_per_group": PER_GROUP, "evaluation_interval_s": EVAL_S,
                             "resends_per_alert": RESENDS, "batch_size": BATCH},
                    "timing": {"group_wait_s": GROUP_WAIT_S, "group_interval_s": GROUP_INTERVAL_S,
                               "repeat_interval_s": REPEAT_INTERVAL_S, "target_s": TARGET_S}}
    try:
        token, result["inferops_route"] = setup_inferops(recorders["inferops"])
        connection.close()
        env = {**os.environ, "DATABASE_URL": scratch_database_url(admin_url, args.database),
               "DJANGO_SETTINGS_MODULE": "project.settings", "PYTHONUNBUFFERED": "1"}
        result["inferops_alert_tick_s"] = float(env.get("INFEROPS_ALERT_TICK_S", 5))
        web_port, am_port = free_port(), free_port()
        python = sys.executable
        processes.start("web", [python, "-m", "uvicorn", "project.asgi:application", "--host", "127.0.0.1",
                                "--port", str(web_port), "--no-access-log"], env)
        processes.start("worker", [python, "-m", "celery", "-A", "inferops.celery", "worker", "--beat",
                                   "--loglevel", "INFO", "--concurrency", "2", "--hostname", "bench-alerts@%h",
                                   "--schedule", str(workdir / "beat-schedule")], env)
        config = ALERTMANAGER_CONFIG.format(group_wait=GROUP_WAIT_S, group_interval=GROUP_INTERVAL_S,
                                            repeat_interval=REPEAT_INTERVAL_S, port=recorders["alertmanager"].port)
        (workdir / "alertmanager.yml").write_text(config)
        result["alertmanager_config"] = config
        am_argv = [args.alertmanager, f"--config.file={workdir / 'alertmanager.yml'}",
                   f"--storage.path={workdir / 'alertmanager-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                   "--cluster.listen-address=", "--log.level=info"]
        result["alertmanager_argv"] = am_argv[1:]
        processes.start("alertmanager", am_argv)

        import httpx

        inferops_url, am_url = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{am_port}"
        wait_for(lambda: httpx.get(f"{inferops_url}/healthz", timeout=2).status_code == 200, 60,
                 "the inferops web app")
        wait_for(lambda: httpx.get(f"{am_url}/-/ready", timeout=2).status_code == 200, 60, "Alertmanager")
        wait_for(lambda: "ready." in processes.log_tail("worker", 20000), 90, "the Celery worker")
        wait_for(lambda: "alerts.advance_groups" in processes.log_tail("worker", 200000), 30,
                 "beat's first alerts.advance_groups")
        log(f"inferops at {inferops_url}, Alertmanager at {am_url}, logs in {workdir}")

        ticks = schedule()
        t0 = time.time() + 2.0
        fired_at: dict = {}
        for index, pairs in enumerate(ticks):
            for pair in pairs:
                fired_at.setdefault(pair, t0 + index * EVAL_S)
        senders = {
            "inferops": Sender("inferops", f"{inferops_url}/api/v1/alerts/alertmanager/",
                               {"Authorization": f"Bearer {token}"}, inferops_body, ticks, t0, fired_at),
            "alertmanager": Sender("alertmanager", f"{am_url}/api/v2/alerts", {}, alertmanager_body, ticks, t0,
                                   fired_at),
        }
        sampler.start()
        for sender in senders.values():
            sender.start()
        log(f"sending {sum(len(p) for p in ticks)} alerts ({len(fired_at)} distinct) over "
            f"{(len(ticks) - 1) * EVAL_S:.0f} s to both")
        for sender in senders.values():
            sender.join()
        last_post = max(p["done"] for s in senders.values() for p in s.posts)
        log(f"load sent; last POST done at {last_post - t0:.1f} s; waiting {SETTLE_S} s")
        time.sleep(max(0.0, last_post + SETTLE_S - time.time()))
        # Deliveries still queued would show here as notification rows not yet sent.
        end_of_load = time.time()
        sampler.stopping.set()
        sampler.join()

        for name in ("inferops", "alertmanager"):
            result[name] = analyse(recorders[name], senders[name], fired_at, t0, end_of_load)
            result[name]["targets"] = verdict(result[name])
        counts = {"opened": 0, "updated": 0, "resolved": 0}
        for post in senders["inferops"].posts:
            try:
                for key, value in json.loads(post["answer"]).items():
                    counts[key] = counts.get(key, 0) + value
            except (ValueError, AttributeError):
                pass
        result["inferops"]["ingest_counts"] = counts
        result["inferops"]["database"] = inferops_state()
        result["alertmanager"]["api"] = alertmanager_state(am_url)
        result["machine"] = sampler.summary()
        result["cpu_samples"] = sampler.samples
        result["inferops"]["worker_log_errors"] = [
            line for line in processes.log_tail("worker", 10**7).splitlines()
            if "ERROR" in line or "Traceback" in line][:20]
        for name in ("inferops", "alertmanager"):
            r = result[name]
            d = r["delay_from_first_alert_sent_s"]
            log(f"{name}: {r['firing_notifications']} firing notifications for {r['groups_notified']} groups "
                f"({r['groups_notified_more_than_once']} more than once), {r['alerts_notified']} alerts notified, "
                f"{r['alerts_missing']} missing, {r['duplicate_alert_mentions']} duplicate; delay p50 {d['p50']} "
                f"p99 {d['p99']} max {d['max']} s; targets {r['targets']}")
        log(f"inferops ingest counts {counts}; machine {result['machine']}")
        out = args.result_json or HERE / f"results-{result['date']}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {out}")
    finally:
        sampler.stopping.set()
        processes.stop_all()
        for recorder in recorders.values():
            recorder.close()
        from django.db import connections

        connections.close_all()
        recreate_scratch_database(admin_url, args.database, drop_only=True)
        if store is not None:
            store.flushdb()
        if args.keep_logs:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
