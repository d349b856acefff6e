"""Faults under load (issue 40): each scenario breaks one part of a whole installation
(tests/reliability/chaos.py) while streamed requests flow through two gateways behind a TCP
balancer, then checks what the issue asks of every scenario:

- no request fails that had not started streaming when a replica died (for the other faults: no
  request fails at all, but those in flight on a gateway killed under them);
- every served request has exactly one usage event in the ledger (none lost, none doubled);
- everything recovers by itself within 30 s of the fault ending: a new request is served, the
  deployment has its replicas ready again, and /healthz is 200 (database, Redis, worker heartbeat).
  "By itself" as deployed: the installation restarts a process that exits on its own, as compose's
  `restart: unless-stopped` and Kubernetes do, and each row counts those restarts.

A short pass (faults of 5 s) runs in `make test`; `make chaos` holds each fault 60 s, loads longer,
and adds the 30-minute soak. Figures go to bench/reliability/results/chaos.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.chaos import FAKETIME_LIB, Installation, Load, descendants, ledger_check, process_rss_kib
from tests.reliability.suite import LONG, record, scaled
from tests.waiting import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(scaled(900, 5400))]

FAULT_S = scaled(5, 60)
AFTER_S = scaled(4, 20)  # load kept up after recovery, so late failures show
RECOVERY_LIMIT_S = 30
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def installation(checkpoint_factory):
    # Not under pytest's own temporary folder: every pytest session makes that 0700 again, and Postgres
    # runs as an unprivileged user (when root) that must reach its data directory for pg_ctl.
    root = Path(tempfile.mkdtemp(prefix="inferops-chaos-"))
    root.chmod(0o755)
    installation = Installation(root, checkpoint_factory("tiny-llama", "llama"))
    try:
        installation.start(replicas=2)
        yield installation
    finally:
        installation.stop()
        record("chaos", {"fault_s": FAULT_S, "scenarios": RESULTS})
        shutil.rmtree(root, ignore_errors=True)


def run(installation: Installation, name: str, fault, *, replicas: int = 2, clients: int = 4,
        done=lambda: True) -> dict:
    """Load, `fault()` (which returns once the fault has ended), recovery (and `done()`), more load, the ledger."""
    restarts_before = installation.restarts.copy()
    load = Load(installation.gateway_url, installation.key, tag=f"{name}-{os.getpid()}-{time.time_ns()}",
                clients=clients).start()
    try:
        wait_until(lambda: sum(o.ok for o in load.outcomes) >= 8, "the load to get going", 60, 0.1)
        fault_started = time.monotonic()
        details = fault() or {}
        fault_ended = time.monotonic()

        def recovered() -> bool:
            return (load.succeeded_since(fault_ended) and installation.healthy()
                    and len(installation.ready_replicas()) >= replicas and done())

        wait_until(recovered, f"{name}: recovery", 120, 0.2)
        recovery_s = time.monotonic() - fault_ended
        time.sleep(AFTER_S)
    finally:
        load.stop()
    row = {"load": f"{clients} clients, streamed", "fault": details.pop("fault", name),
           "fault_held_s": round(fault_ended - fault_started, 1), **load.summary(),
           **ledger_check(installation, load), "recovery_s": round(recovery_s, 1),
           "restarted_by_supervisor": dict(installation.restarts - restarts_before), **details}
    RESULTS[name] = row
    print(f"chaos {name}: {row}")
    assert row["recovery_s"] <= RECOVERY_LIMIT_S, row
    assert row["events_lost"] == 0 and row["events_doubled"] == 0, row
    return row


def stopped_for_a_while(what: str, stop, start):
    """A fault: `stop()`, FAULT_S seconds, `start()`."""
    def fault():
        stop()
        time.sleep(FAULT_S)
        start()
        return {"fault": f"{what} stopped {FAULT_S} s, restarted"}

    return fault


def assert_none_failed(row: dict) -> None:
    assert row["failed_before_first_byte"] == 0 and row["failed_after_first_byte"] == 0, row


def test_replica_sigkill(installation):
    def fault():
        os.kill(installation.ready_replicas()[0], signal.SIGKILL)
        return {"fault": "a replica SIGKILLed"}

    row = run(installation, "replica_sigkill", fault)
    assert row["failed_before_first_byte"] == 0, row


def test_replica_frozen(installation):
    def fault():
        pid = installation.ready_replicas()[0]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(FAULT_S)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the worker replaced it already
        return {"fault": f"a replica frozen (SIGSTOP) {FAULT_S} s"}

    row = run(installation, "replica_sigstop", fault)
    assert row["failed_before_first_byte"] == 0, row


def worker_killed_during(installation: Installation, change: str, under_way: str, what: str):
    """A fault: `change` (code for `manage.py shell`); once the SQL count `under_way` finds a row, the
    worker SIGKILLed, and started again 2 s later, as a supervisor would."""
    def fault():
        installation.shell(change)
        wait_until(lambda: installation.sql(under_way)[0][0] > 0, what, 30, 0.05)
        installation.kill("worker")
        time.sleep(2)
        installation.start_worker()
        return {"fault": f"the worker SIGKILLed while {what}, restarted 2 s later"}

    return fault


def scale(replicas: int) -> str:
    """Code for `manage.py shell` that scales chat to `replicas`."""
    return ("from deployments.models import Deployment; from deployments import services; services.deployment_update("
            f"deployment=Deployment.objects.get(name='chat'), actor=None, replicas={replicas})")


def test_worker_killed_mid_reconcile(installation):
    fault = worker_killed_during(
        installation, scale(3),
        "SELECT count(*) FROM runtime_replica r JOIN deployments_deployment d ON d.id = r.deployment_id "
        "WHERE d.name = 'chat' AND r.state = 'starting'", "it starts a third replica")
    assert_none_failed(run(installation, "worker_sigkill_mid_reconcile", fault, replicas=3))
    # Nothing orphaned: every replica process the worker started belongs to a row, and no row lost its process.
    rows = {pid for (pid,) in installation._replica_pids()}
    known = rows | {child for pid in rows for child in descendants(pid)}  # a replica's own children
    running = set(map(int, subprocess.run(["pgrep", "-f", str(installation.checkpoint)], capture_output=True,
                                          text=True).stdout.split()))
    assert running <= known, f"replica processes no row knows: {running - known}"
    installation.shell(scale(2))
    wait_until(lambda: len(installation.ready_replicas()) == 2, "back to two replicas", 60, 0.2)


def test_worker_killed_mid_rollout(installation):
    def rollout_status() -> str:
        rows = installation.sql("SELECT status FROM deployments_rollout ORDER BY id DESC LIMIT 1")
        return rows[0][0] if rows else ""

    # Killed while the candidate's replica starts: the rollout's first step is under way.
    fault = worker_killed_during(
        installation,
        "from deployments.models import Deployment; from deployments.rollouts import services; "
        "services.rollout_create(deployment=Deployment.objects.get(name='chat'), actor=None, "
        "version=2, steps=[{'set_weight': 50}, {'pause': '4s'}], watch=0)",
        "SELECT count(*) FROM runtime_replica r JOIN registry_modelversion v ON v.id = r.version_id WHERE v.number = 2",
        "a canary rollout starts its candidate")
    row = run(installation, "worker_sigkill_mid_rollout", fault, done=lambda: rollout_status() == "succeeded")
    row["rollout"] = rollout_status()
    assert_none_failed(row)


def test_beat_stopped_and_restarted(installation):
    fault = stopped_for_a_while("beat", lambda: installation.kill("beat", signal.SIGTERM), installation.start_beat)
    assert_none_failed(run(installation, "beat_restart", fault))


def test_redis_down(installation):
    fault = stopped_for_a_while("Redis", installation.stop_redis, installation.start_redis)
    assert_none_failed(run(installation, "redis_down", fault))


def test_postgres_down(installation):
    fault = stopped_for_a_while("Postgres", installation.stop_postgres, installation.restart_postgres)
    assert_none_failed(run(installation, "postgres_down", fault))


def test_gateway_killed_behind_the_balancer(installation):
    killed_at: list[float] = []

    def fault():
        killed_at.append(time.monotonic())
        installation.kill("gateway0")
        time.sleep(FAULT_S)
        installation.start_gateway(0)
        return {"fault": f"one of two gateways SIGKILLed, restarted {FAULT_S} s later"}

    row = run(installation, "gateway_sigkill", fault)
    # Only requests in flight on the killed gateway may fail; the balancer sends the next ones elsewhere.
    assert row["sent"] - row["served"] <= 4, row


def test_usage_spool_disk_full(installation):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the spool needs root")
    spools = [installation.spool_dir(index) for index in range(2)]
    for spool in spools:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(spool)], capture_output=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        def fault():
            installation.processes["redis"].terminate()
            installation.processes["redis"].wait(30)
            # Until both spools are full and events pile up behind them.
            wait_until(lambda: all(_full(spool) for spool in spools), "the spools to fill", scaled(60, 120), 0.2)
            time.sleep(FAULT_S)
            installation.start_redis()
            return {"fault": f"Redis stopped and the usage spool's disk (16 KiB) full for {FAULT_S} s"}

        assert_none_failed(run(installation, "spool_disk_full", fault))
        wait_until(lambda: all(not any(p.stat().st_size for p in spool.iterdir()) for spool in spools),
                   "the spools to be replayed", 30, 0.2)
    finally:
        for spool in spools:
            subprocess.run(["umount", "-l", str(spool)], capture_output=True)


def _full(spool: Path) -> bool:
    stats = os.statvfs(spool)
    return stats.f_bavail * stats.f_frsize < 2048


def test_gateway_clock_minutes_ahead(installation):
    if FAKETIME_LIB is None:
        pytest.skip("libfaketime is not installed (.ci/deps installs it)")

    def fault():
        time.sleep(FAULT_S)  # the load runs through both gateways, one of them skewed, all along
        return {"fault": "one of two gateways with its clock 5 min ahead of the control plane's"}

    installation.kill("gateway1", signal.SIGTERM)
    installation.start_gateway(1, skew="+5m")
    try:
        row = run(installation, "clock_skew", fault)
        assert_none_failed(row)
        # The ledger dates usage by one clock: no minute of it lies in the future.
        ahead_s = installation.sql("SELECT extract(epoch FROM max(time) - now()) FROM tenants_usageevent")[0][0]
        row["latest_event_ahead_of_now_s"] = round(float(ahead_s), 1)
        print(f"clock skew: the latest usage event is {ahead_s:.1f} s ahead of the database's clock")
        assert ahead_s < 60, "usage dated by the skewed gateway's clock"
    finally:
        installation.kill("gateway1", signal.SIGTERM)
        installation.start_gateway(1)


@pytest.mark.skipif(not LONG, reason="the 30-minute soak runs in `make chaos`")
def test_soak_at_70_percent_of_saturation(installation):
    """Saturation is measured first (16 closed-loop clients); then 30 minutes at 70 % of it, with the
    resident memory of every process sampled; growth after a 5-minute warm-up stays within 5 %."""
    probe = Load(installation.gateway_url, installation.key, tag=f"saturation-{time.time_ns()}", clients=16).start()
    time.sleep(10)  # warm
    served_before, probe_started = sum(o.ok for o in probe.outcomes), time.monotonic()
    time.sleep(60)
    saturation = (sum(o.ok for o in probe.outcomes) - served_before) / (time.monotonic() - probe_started)
    probe.stop()
    duration_s = int(os.environ.get("INFEROPS_CHAOS_SOAK_S", 1800))  # shorter only to try the test itself
    warmup_s, every_s = duration_s // 6, max(5, min(30, duration_s // 30))
    load = Load(installation.gateway_url, installation.key, tag=f"soak-{time.time_ns()}", clients=32,
                rate=0.7 * saturation).start()
    pids = {name: process.pid for name, process in installation.processes.items()}
    pids |= {f"replica{index}": pid for index, pid in enumerate(installation.ready_replicas())}
    samples: list[dict[str, int]] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < duration_s:
            time.sleep(every_s)
            samples.append({name: process_rss_kib(pid) for name, pid in pids.items()})
    finally:
        load.stop()
    after_warmup = samples[warmup_s // every_s]
    last = samples[-3:]
    growth = {name: round(100 * (sum(s[name] for s in last) / len(last) - after_warmup[name]) / after_warmup[name], 1)
              for name in pids if after_warmup[name]}
    summary = load.summary()
    RESULTS["soak"] = {"load": f"{0.7 * saturation:.1f} req/s (70 % of {saturation:.1f})", "duration_s": duration_s,
                       **summary, **ledger_check(installation, load, 120), "rss_growth_percent": growth,
                       "rss_kib_after_warmup": after_warmup, "rss_kib_last": samples[-1]}
    print(f"soak: {RESULTS['soak']}")
    assert summary["sent"] == summary["served"], summary
    assert max(growth.values()) <= 5, growth


def test_no_secret_in_anything_the_run_wrote(installation):
    """Last, after every scenario: API keys, API tokens, the integration token, the receiver's routing key,
    SECRET_KEY and the replicas' admin token appear nowhere the installation wrote them for people or
    other systems to read: logs, the usage spool and Redis's append-only file, any database row (but the
    receiver's, which must keep its key to use it, and DRF's token table), error answers, and exports."""
    made = json.loads(installation.shell("""
import json
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from alerts.inbound.alertmanager import integration_create
from alerts.services import receiver_save
from inferops.replica_admin import replica_admin_token
admin = User.objects.create_superuser("secrets-admin", "", "pw-secrets-admin-123")
receiver = receiver_save(instance=None, actor=admin, fields={"name": "pager", "kind": "pagerduty",
    "url": "http://127.0.0.1:9/v2/enqueue", "routing_key": "R0UTINGKEY" + "x" * 22})
print(json.dumps({"token": Token.objects.create(user=admin).key,
                  "integration": integration_create(name="team-am", actor=admin)[1],
                  "routing_key": receiver.routing_key, "replica_admin": replica_admin_token()}))
""").splitlines()[-1])
    secrets_ = {"tenant API key": installation.key, "API token": made["token"],
                "integration token": made["integration"],
                "receiver routing key": made["routing_key"], "replica admin token": made["replica_admin"],
                "SECRET_KEY": installation.env()["SECRET_KEY"]}
    web = f"http://127.0.0.1:{installation.web_port}"
    answers: list[str] = []

    def keep(response: httpx.Response) -> httpx.Response:
        answers.append(f"{response.request.method} {response.request.url} -> {response.status_code} "
                       f"{dict(response.headers)} {response.text}")
        return response

    api = httpx.Client(base_url=web, headers={"Authorization": f"Token {made['token']}"}, timeout=30)
    # The integration's token at work: an alert, routed to the receiver, whose deliveries fail (nothing on :9).
    alert = {"version": "4", "alerts": [{"status": "firing", "annotations": {}, "startsAt": "2026-01-01T00:00:00Z",
                                         "labels": {"alertname": "SecretsProbe", "severity": "page"}}]}
    assert keep(httpx.post(f"{web}/api/v1/alerts/alertmanager/", json=alert, timeout=30,
                           headers={"Authorization": f"Bearer {made['integration']}"})).status_code < 300
    # Near misses: each secret with a character more, where each is checked.
    keep(httpx.get(f"{web}/api/v1/models/", headers={"Authorization": f"Token {made['token']}x"}))
    keep(httpx.post(f"{web}/api/v1/alerts/alertmanager/", json=alert,
                    headers={"Authorization": f"Bearer {made['integration']}x"}))
    for headers in ({"Authorization": f"Bearer {installation.key}x"}, {"Authorization": installation.key},
                    {"Authorization": f"Bearer {installation.key}"}):
        keep(httpx.post(f"{installation.gateway_url}/v1/chat/completions", headers=headers, timeout=30,
                        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}))
    # What people read and export.
    for path in ("/api/v1/audit/?limit=1000", "/api/v1/usage/?step=1d", "/api/v1/receivers/", "/api/v1/integrations/",
                 "/api/v1/keys/", "/api/v1/tenants/"):
        keep(api.get(path))
    console = httpx.Client(base_url=web, timeout=30, follow_redirects=True)
    csrf = console.get("/login/").cookies["csrftoken"]
    console.post("/login/", data={"username": "secrets-admin", "password": "pw-secrets-admin-123",
                                  "csrfmiddlewaretoken": csrf})
    for path in ("/audit/", "/alerts/receivers/", "/costs/export.csv", "/tenants/acme/"):
        keep(console.get(path))
    wait_until(lambda: installation.sql("SELECT count(*) FROM alerts_delivery")[0][0] > 0,
               "a delivery to the receiver", 60, 0.5)

    found: list[str] = []

    def scan(where: str, text: str) -> None:
        found.extend(f"{name} in {where}" for name, secret in secrets_.items() if secret in text)

    for path in installation.root.rglob("*"):
        if path.is_file() and "pg" not in path.relative_to(installation.root).parts:
            scan(str(path.relative_to(installation.root)), path.read_bytes().decode("utf-8", "replace"))
    tables = [name for (name,) in installation.sql(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")]
    for table in tables:
        if table in ("alerts_receiver", "authtoken_token"):
            continue  # the receiver must keep its key to use it; DRF keeps token keys to compare them
        for (row,) in installation.sql(f'SELECT t::text FROM "{table}" t'):
            scan(f"table {table}", row)
    for answer in answers:
        scan(f"answer {answer[:80]}", answer)
    assert len(answers) == 16 and len(tables) > 40
    # The control: what is there is found (the receiver keeps its key, to use it).
    receivers = installation.sql("SELECT t::text FROM alerts_receiver t")
    assert made["routing_key"] in " ".join(row for (row,) in receivers)
    assert found == []
