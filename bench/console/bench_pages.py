"""Console page load, cold and warm, in a real Chromium (issue 30's figures).

Seeds a scratch database with a day of console data (3 models with versions, 4 deployments with
2 replicas each and a day of per-minute replica metrics, usage events and their minute ledger for
6 tenants, 8 SLOs created a day ago and evaluated (the first cycle backfills their minute rows),
the alerts that evaluation and an integration opened, an audit log), starts the console as
`inferops run` does (`python -m uvicorn project.asgi:application --no-access-log`, DEBUG off,
static files through WhiteNoise) on a free port, and drives Debian's Chromium through Playwright, logged in as an admin.

For each page, `--reps` times: COLD is a fresh browser context (empty HTTP cache, the session
cookie only), WARM is the same page loaded again in that context. Each load records, from the
page's own Navigation and Paint Timing: responseEnd (the server's HTML is in), first-contentful-
paint, DOMContentLoaded, load, and on chart pages the moment the first plotly chart exists
(`.js-plotly-plot`, seen by a MutationObserver), all in ms from navigation start.

Peers in the same run:
- the Django admin's change lists on the same server (plain server-rendered pages, no charts);
- each chart page with plotly's full bundle (the plotly Python package's, served by a pass-through
  proxy in this process with the console's own gzip and cache headers) against the same page as
  served (the partial bundle) through the same proxy, so both carry its hop. The two variants
  alternate load by load (paired samples), so a busy moment on a shared machine hits both.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/5 \\
        INFEROPS_DATA_DIR=/tmp/inferops-pages .venv/bin/python bench/console/bench_pages.py [--reps 7]

Writes bench/console/results-<date>.json and prints a table (medians, p90 over the reps).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from scratch import (  # noqa: E402
    ROOT,
    django_on_scratch_database,
    free_port,
    log,
    percentile,
    recreate_scratch_database,
    wait_for,
)

SCRATCH_DB = "inferops_bench_pages"
USERNAME, PASSWORD = "bench-admin", "bench-admin-pw-1234"
CHROMIUM = "/usr/bin/chromium"
# As tests/browser/conftest.py: a closed network, no background calls home.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TENANTS = ["acme", "globex", "initech", "umbrella", "hooli", "stark"]
DEPLOYMENTS = [("chat", "llama-3-8b"), ("chat-large", "llama-3-70b"), ("summarize", "qwen-7b"), ("batch", "qwen-7b")]
EVENTS_PER_MINUTE = 6  # per deployment: ~35,000 events a day over 4 deployments

# Records when the first plotly chart appears: plotly marks its div with this class as it draws.
CHART_OBSERVER = """
(() => {
  const seen = () => {
    if (window.__firstChart === undefined && document.querySelector('.js-plotly-plot')) {
      window.__firstChart = performance.now();
    }
  };
  new MutationObserver(seen).observe(document, {subtree: true, childList: true, attributes: true,
                                                 attributeFilter: ['class']});
})();
"""
TIMINGS = """() => {
  const n = performance.getEntriesByType('navigation')[0];
  const fcp = performance.getEntriesByName('first-contentful-paint')[0];
  return {response_start: n.responseStart, response_end: n.responseEnd, fcp: fcp ? fcp.startTime : null,
          dcl: n.domContentLoadedEventEnd, load: n.loadEventEnd,
          chart: window.__firstChart === undefined ? null : window.__firstChart,
          transfer_kb: performance.getEntriesByType('resource')
                         .reduce((s, r) => s + r.transferSize, n.transferSize) / 1024};
}"""
METRICS = ["response_end", "fcp", "dcl", "load", "chart"]


# ---------------------------------------------------------------------------- seeding


def version_fields(number: int) -> dict:
    return dict(number=number, artifact_uri=f"/models/v{number}", digest=f"{number:064x}",
                architecture="LlamaForCausalLM", parameter_count=8_000_000_000, hidden_size=4096, num_layers=32,
                num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, max_context=8192,
                dtype="bfloat16", weight_bytes=16_000_000_000, kv_cache_bytes_per_token=131072,
                has_tokenizer=True, has_chat_template=True)


def seed(now: datetime) -> dict:
    """A day of a small installation's data, ending at `now` (a whole minute)."""
    from django.contrib.auth.models import Group, User
    from django.db import connection

    from alerts.models import Alert, Integration
    from alerts.schedules.services import schedule_save
    from alerts.services import alert_acknowledge, alert_raise, alert_resolve
    from costing.ledger import ledger_sync
    from costing.services import price_create
    from deployments.models import Deployment, Replica, ReplicaMetricsMinute
    from inferops.audit import audit_record, snapshot
    from inferops.models import AuditEvent
    from registry.models import ModelVersion, RegisteredModel
    from slo.evaluation import evaluate_slos
    from slo.models import Slo
    from tenants import services as tenant_services
    from tenants.models import UsageEvent, UsageMinute

    rng = random.Random(30)
    start = now - timedelta(days=1)
    admin = User.objects.create_superuser(USERNAME, "bench@example.com", PASSWORD)
    if group := Group.objects.filter(name="admin").first():
        admin.groups.add(group)

    versions = {}
    for name, count in (("llama-3-8b", 3), ("llama-3-70b", 2), ("qwen-7b", 2)):
        model = RegisteredModel.objects.create(name=name, task="generate", created_by=admin)
        audit_record(actor=admin, action="model.create", obj=model, after=snapshot(model))
        for number in range(1, count + 1):
            version = ModelVersion.objects.create(model=model, **version_fields(number))
            audit_record(actor=admin, action="version.register", obj=version, after=snapshot(version))
        versions[name] = version

    deployments, replicas = [], []
    for index, (name, model_name) in enumerate(DEPLOYMENTS):
        version = versions[model_name]
        deployment = Deployment.objects.create(
            name=name, model=version.model, version=version, replicas=2, min_replicas=1, max_replicas=4,
            driver="kubernetes", status="ready", engine_args={"max_num_seqs": 64, "max_model_len": 8192},
            resources={"gpu_type": "H100", "gpu_count": 1, "cpu": "8", "memory": "64Gi"}, created_by=admin)
        audit_record(actor=admin, action="deployment.create", obj=deployment, after=snapshot(deployment))
        deployments.append(deployment)
        for r in range(2):
            replicas.append(Replica.objects.create(
                deployment=deployment, version=version, driver="kubernetes", node=f"gpu-node-{index}{r}",
                url=f"http://10.0.{index}.{r + 10}:8000", port=8000, state="ready", started_at=start,
                ready_at=start + timedelta(minutes=2), last_health_at=now, last_health_ok=True))
    Replica.objects.update(created_at=start)

    # Per-minute replica metrics for the day.
    rows = []
    for replica in replicas:
        for m in range(24 * 60):
            load = 0.5 + 0.4 * ((m // 60) % 12) / 12 + rng.random() * 0.1
            requests = int(40 * load)
            rows.append(ReplicaMetricsMinute(
                replica=replica, deployment=replica.deployment, version=replica.version,
                start=start + timedelta(minutes=m), scrapes=4, running_avg=8 * load, running_max=12 * load,
                waiting_avg=rng.random() * 2, waiting_max=3, kv_cache_usage_avg=0.3 + 0.5 * load,
                kv_cache_usage_max=0.9 * load, prompt_tokens=requests * 400, generation_tokens=requests * 180,
                requests_by_reason={"stop": requests - 2, "length": 2},
                ttft_buckets={"0.05": requests // 4, "0.1": requests // 2, "0.25": requests - 3, "0.5": requests,
                              "+Inf": requests},
                ttft_sum=0.12 * requests, ttft_count=requests,
                itl_buckets={"0.01": requests * 100, "0.025": requests * 170, "+Inf": requests * 180},
                itl_sum=requests * 180 * 0.012, itl_count=requests * 180,
                e2e_buckets={"1": requests // 2, "2.5": requests, "+Inf": requests}, e2e_sum=requests * 1.2,
                e2e_count=requests))
    ReplicaMetricsMinute.objects.bulk_create(rows, batch_size=5000)

    # Usage: events and their minute ledger. "chat" has a bad hour 6 h ago (30 % 503s) and slow
    # first tokens for the last 2.5 h, so the SLOs burn and open alerts.
    events, minutes = [], {}
    for deployment in deployments:
        for m in range(24 * 60):
            at = start + timedelta(minutes=m)
            bad_hour = deployment.name == "chat" and 17 * 60 <= m < 18 * 60
            slow = deployment.name == "chat" and m >= 21 * 60 + 30  # the last 2.5 h
            for e in range(EVENTS_PER_MINUTE):
                tenant = TENANTS[(m + e) % len(TENANTS)]
                failed = bad_hour and rng.random() < 0.3
                ttft = rng.uniform(900, 2000) if slow and rng.random() < 0.5 else rng.uniform(40, 300)
                prompt, completion = rng.randrange(100, 2000), rng.randrange(20, 400)
                events.append(UsageEvent(
                    request_id=f"{deployment.name}-{m}-{e}", time=at + timedelta(seconds=e * 9), tenant=tenant,
                    key_prefix=tenant[:8].ljust(8, "0"), deployment=deployment.name, version=deployment.version.number,
                    replica=replicas[deployments.index(deployment) * 2 + e % 2].pk, endpoint="chat", stream=True,
                    prompt_tokens=prompt, completion_tokens=0 if failed else completion,
                    ttft_ms=None if failed else ttft, tpot_ms=None if failed else 12.0, e2e_ms=ttft + 12 * completion,
                    status=503 if failed else 200, finish_reason=None if failed else "stop",
                    error_kind="upstream_error" if failed else None, ingested_at=at + timedelta(seconds=e * 9 + 2)))
                row = minutes.setdefault((at, tenant, deployment.name), UsageMinute(
                    minute=at, tenant=tenant, key_prefix=tenant[:8].ljust(8, "0"), deployment=deployment.name,
                    version=deployment.version.number))
                row.requests += 1
                row.errors += failed
                row.prompt_tokens += prompt
                row.completion_tokens += 0 if failed else completion
                if not failed:
                    row.ttft_sum_ms += ttft
                    row.ttft_count += 1
                row.e2e_sum_ms += ttft + 12 * completion
                row.e2e_count += 1
    UsageEvent.objects.bulk_create(events, batch_size=5000)
    UsageMinute.objects.bulk_create(minutes.values(), batch_size=5000)

    for tenant in TENANTS:
        made = tenant_services.tenant_create(name=tenant, actor=admin, display_name=tenant.title(), rpm_limit=600)
        for k in range(2):
            tenant_services.key_create(tenant=made, name=f"{tenant}-key-{k}", actor=admin)

    slos = []
    for deployment in deployments:
        slos.append(Slo.objects.create(name=f"{deployment.name}-availability", deployment=deployment,
                                       sli_kind="availability", objective=0.995, window="1d", created_by=admin))
        slos.append(Slo.objects.create(name=f"{deployment.name}-ttft", deployment=deployment, sli_kind="latency",
                                       ttft_ms=500, objective=0.99, window="1d", created_by=admin))
    Slo.objects.update(created_at=start)
    # The first evaluation backfills each SLO's minute rows from its creation (a day ago): the
    # charts' history; later cycles fold only what was ingested since (nothing here).
    moments = [now - timedelta(minutes=2), now]
    for moment in moments:
        evaluate_slos(now=moment)

    integration = Integration.objects.create(name="prometheus", token_prefix="bench", token_hash="0" * 64,
                                             created_by=admin)
    for i in range(12):
        labels = {"alertname": rng.choice(["NodeDiskFull", "GPUXidError", "HighMemory"]), "instance": f"gpu-node-{i}"}
        at = start + timedelta(hours=2 * i)
        alert = alert_raise(labels=labels, annotations={"summary": f"{labels['alertname']} on {labels['instance']}"},
                            severity=rng.choice(["page", "ticket"]), now=at, integration=integration)
        if i % 3 == 0:
            alert_resolve(alert=alert, now=at + timedelta(minutes=40))
        elif i % 3 == 1:
            alert_acknowledge(alert=alert, actor=admin)

    # An on-call schedule (its page charts the coming shifts) and a priced day (the cost report's charts).
    schedule_save(instance=None, fields={"name": "primary", "time_zone": "UTC", "description": ""},
                  layers=[{"name": "weekly", "rotation": "weekly", "starts_at": start, "ends_at": None,
                           "users": [USERNAME]}], actor=admin)
    for resource, usd in (("gpu:H100", "2.50"), ("cpu", "0.04"), ("memory", "0.005")):
        price_create(resource=resource, usd_per_hour=Decimal(usd), effective_from=start - timedelta(days=1),
                     tier="on-demand", actor=admin)
    ledger_sync(now)

    # A month of console changes in the audit log (deployments scaled, limits moved).
    for i in range(400):
        deployment = deployments[i % len(deployments)]
        before = snapshot(deployment)
        after = {**before, "replicas": 1 + i % 4}
        audit_record(actor=admin, action="deployment.update", obj=deployment, before=before, after=after)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # what autovacuum keeps up to date on a live system
    return {"model_versions": ModelVersion.objects.count(), "deployments": len(deployments),
            "replicas": len(replicas), "replica_metric_minutes": len(rows), "usage_events": len(events),
            "usage_minutes": len(minutes), "tenants": len(TENANTS), "slos": len(slos),
            "slo_evaluations": len(moments), "alerts": Alert.objects.count(),
            "open_alerts": Alert.objects.filter(ends_at__isnull=True).count(),
            "audit_events": AuditEvent.objects.count()}


# ---------------------------------------------------------------------------- the server


def start_console(port: int) -> subprocess.Popen:
    env = {**os.environ, "DEBUG": "false", "DJANGO_SETTINGS_MODULE": "project.settings"}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    # As project/launcher.py `children` starts the web process.
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "project.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--no-access-log"], cwd=ROOT, env=env, start_new_session=True)
    wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200, 60,
             "the console to answer /healthz")
    return process


# ---------------------------------------------------------------------------- the browser


FULL_BUNDLE_PATH = "/bench/plotly-full.min.js"
PLOTLY_TAG = re.compile(r'<script defer src="/assets/plotly-[0-9a-f]+\.min\.js" onload="plotlyLoaded\(\)"></script>')


def full_plotly(html: str) -> str:
    """The page with plotly's full bundle in place of the partial one, loaded the same way (deferred)."""
    html, n = PLOTLY_TAG.subn(f'<script defer src="{FULL_BUNDLE_PATH}" onload="plotlyLoaded()"></script>', html)
    if n != 1:
        raise SystemExit("the plotly partial changed: no deferred plotly tag to swap")
    return html


def full_bundle_response() -> tuple[bytes, bytes]:
    """The plotly package's full bundle, plain and gzipped as the console gzips its own."""
    import gzip

    from inferops.assets import full_bundle_path

    plain = full_bundle_path().read_bytes()
    return plain, gzip.compress(plain, compresslevel=6, mtime=0)


class RewritingProxy:
    """A pass-through HTTP proxy in front of the console that rewrites one page's HTML and serves
    plotly's full bundle at FULL_BUNDLE_PATH with the console's headers (plotly_js).

    Not Playwright's route interception: routing turns Chromium's HTTP cache off, and a warm load
    without its cache is not a warm load. Both variants of a chart page go through the proxy, so
    both pay its hop."""

    def __init__(self, upstream_port: int) -> None:
        self.rewrites: dict[str, object] = {}
        self.full_plain, self.full_gzipped = full_bundle_response()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as against uvicorn directly

            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == FULL_BUNDLE_PATH:
                    return self.full_bundle()
                rewrite = proxy.rewrites.get(self.path)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                if rewrite is not None:
                    headers.pop("Accept-Encoding", None)
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                try:
                    upstream.request("GET", self.path, headers=headers)
                    response = upstream.getresponse()
                    body = response.read()
                    passed = [(k, v) for k, v in response.getheaders()
                              if k.lower() not in ("transfer-encoding", "connection", "content-length")]
                finally:
                    upstream.close()
                if rewrite is not None and response.status == 200:
                    body = rewrite(body.decode()).encode()
                self.send_response(response.status)
                for key, value in passed:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.send_body(body)

            def send_body(self, body: bytes) -> None:
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the browser navigated on (a page that polls) before this answer was in

            def full_bundle(self):
                packed = "gzip" in self.headers.get("Accept-Encoding", "")
                body = proxy.full_gzipped if packed else proxy.full_plain
                self.send_response(200)
                self.send_header("Content-Type", "application/javascript")
                if packed:
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Vary", "Accept-Encoding")
                self.send_header("Cache-Control", f"public, max-age={365 * 24 * 3600}, immutable")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.send_body(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def load_once(browser, storage, url: str, *, chart: bool) -> dict:
    """One cold load in a fresh context and one warm load after it: {"cold": timings, "warm": timings}."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, storage_state=storage)
    context.add_init_script(CHART_OBSERVER)
    page = context.new_page()
    timings = {}
    for kind in ("cold", "warm"):
        response = page.goto(url, wait_until="load", timeout=60000)
        if response is None or response.status != 200 or "/login/" in page.url:
            raise SystemExit(f"{url}: {response and response.status} at {page.url}")
        if chart:
            try:
                page.wait_for_function("window.__firstChart !== undefined", timeout=60000)
            except Exception as error:  # noqa: BLE001 - name the page, then stop
                page.screenshot(path=f"/tmp/bench-pages-{kind}.png", full_page=True)
                raise SystemExit(f"{url}: no plotly chart drawn within 60 s ({kind})") from error
        time.sleep(0.1)  # let the paint entries settle
        timings[kind] = page.evaluate(TIMINGS)
        # The page's other chart requests finish before the next load: the single server
        # process still busy with them would be charged to the next page's responseEnd.
        try:
            page.wait_for_load_state("networkidle", timeout=15000)
        except Exception:  # noqa: BLE001 - a page that polls may never be idle for 500 ms
            pass
    context.close()
    return timings


def summarise(path: str, runs: dict) -> dict:
    summary = {}
    for kind, samples in runs.items():
        summary[kind] = {}
        for metric in METRICS + ["response_start", "transfer_kb"]:
            values = [s[metric] for s in samples if s[metric] is not None]
            if values:
                summary[kind][metric] = {"median": round(statistics.median(values), 1),
                                         "p90": round(percentile(values, 90), 1), "n": len(values)}
    return {"path": path, "summary": summary, "samples": runs}


def measure(browser, storage, base: str, path: str, *, chart: bool, reps: int) -> dict:
    runs = {"cold": [], "warm": []}
    for _ in range(reps):
        for kind, timings in load_once(browser, storage, base + path, chart=chart).items():
            runs[kind].append(timings)
    return summarise(path, runs)


def measure_paired(browser, storage, proxy: RewritingProxy, path: str, variants: dict, reps: int) -> dict:
    """Each variant (name -> HTML rewrite) of a chart page through the proxy, alternating load by load
    (the order flips every rep), so that the machine's load at a moment hits both; with the ratio of
    each pair's cold figures (second variant / first)."""
    names = list(variants)
    runs = {name: {"cold": [], "warm": []} for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            proxy.rewrites = {path: variants[name]}
            for kind, timings in load_once(browser, storage, f"http://127.0.0.1:{proxy.port}{path}",
                                           chart=True).items():
                runs[name][kind].append(timings)
    entries = {name: summarise(path, runs[name]) for name in names}
    ratios = {}
    for metric in ("fcp", "dcl", "chart"):
        pairs = [(a[metric], b[metric]) for a, b in zip(runs[names[0]]["cold"], runs[names[1]]["cold"], strict=True)
                 if a[metric] and b[metric]]
        if pairs:
            ratios[metric] = round(statistics.median(b / a for a, b in pairs), 2)
    return {"variants": entries, "cold_ratio_median": ratios}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def pages(seeded_ids: dict) -> list[tuple[str, str, bool, str]]:
    """(name, path, has charts, group)."""
    return [
        ("home", "/", False, "console"),
        ("deployment list", "/deployments/", False, "console"),
        ("deployment page", "/deployments/chat/", True, "console"),
        ("SLO page", f"/slos/{seeded_ids['slo']}/", True, "console"),
        ("alert list", "/alerts/", False, "console"),
        ("alert page", f"/alerts/{seeded_ids['alert']}/", True, "console"),
        ("model list", "/models/", False, "console"),
        ("tenant list", "/tenants/", False, "console"),
        ("tenant page", "/tenants/acme/", True, "console"),
        ("cost report", "/costs/", True, "console"),
        ("schedule page", "/alerts/schedules/primary/", True, "console"),
        ("audit log", "/audit/", False, "console"),
        ("admin: deployments", "/admin/deployments/deployment/", False, "peer: Django admin"),
        ("admin: audit events", "/admin/inferops/auditevent/", False, "peer: Django admin"),
    ]


def bundle_sizes(base: str) -> dict:
    """What the console serves (it must be the partial bundle: `make install`) and the full bundle, in KB."""
    from inferops.templatetags.console import plotly_src

    served = urllib.request.urlopen(base + plotly_src()).read()
    plain, gzipped = full_bundle_response()
    if len(served) > len(plain) / 2:
        raise SystemExit("the console serves plotly's full bundle: run `make install` (npm ci) first")
    return {"served": round(len(served) / 1024), "full": round(len(plain) / 1024),
            "full_gzipped": round(len(gzipped) / 1024)}


def cell(entry: dict, kind: str, metric: str) -> str:
    figure = entry["summary"][kind].get(metric)
    return "-" if figure is None else f"{figure['median']:.0f}/{figure['p90']:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--database", default=SCRATCH_DB)
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    parser.add_argument("--result-json", type=Path, help="default: bench/console/results-<date>.json")
    args = parser.parse_args()
    if os.environ.get("REDIS_URL", "").rstrip("/").split("/")[-1] in ("", "0", "6379"):
        sys.exit("use a Redis database of the benchmark's own (REDIS_URL=redis://127.0.0.1:6379/5): "
                 "the seeding enqueues tasks there that no worker must pick up")
    os.environ.setdefault("INFEROPS_DATA_DIR", "/tmp/inferops-pages")
    Path(os.environ["INFEROPS_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
    os.environ["DEBUG"] = "false"
    load_before = os.getloadavg()
    admin_url = django_on_scratch_database(args.database)
    server = proxy = None
    try:
        from django.core.management import call_command
        from django.utils import timezone

        from alerts.models import Alert
        from slo.models import Slo

        call_command("migrate", interactive=False, verbosity=0)
        now = timezone.now().replace(second=0, microsecond=0)
        log("seeding")
        started = time.monotonic()
        seeded = seed(now)
        log(f"seeded in {time.monotonic() - started:.0f} s: {seeded}")
        ids = {"slo": Slo.objects.get(name="chat-availability").pk,
               "alert": Alert.objects.filter(slo__isnull=False).order_by("starts_at").first().pk}
        from django.db import connections

        connections.close_all()
        port = free_port()
        server = start_console(port)
        base = f"http://127.0.0.1:{port}"
        proxy = RewritingProxy(port)
        log(f"console on {base}, the peers' proxy on port {proxy.port}")

        from playwright.sync_api import sync_playwright

        results: dict = {
            "date": datetime.now(UTC).date().isoformat(), "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpu": cpu_model(),
            "cores": os.cpu_count(), "load_average_before": [round(v, 2) for v in load_before], "reps": args.reps,
            "seeded": seeded, "units": "ms from navigation start; median/p90 over reps", "pages": {}, "paired": {},
            "bundles_kb": bundle_sizes(base)}
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            results["chromium"] = browser.version
            context = browser.new_context()
            page = context.new_page()
            page.goto(f"{base}/login/")
            page.fill("#id_username", USERNAME)
            page.fill("#id_password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")
            storage = context.storage_state()
            context.close()
            # One untimed pass so that every view's first-request costs (imports, template
            # compilation, connection set-up) are out of the figures: a console that has been up.
            for _, path, chart, _ in pages(ids):
                measure(browser, storage, base, path, chart=chart, reps=1)
            for name, path, chart, group in pages(ids):
                log(f"{name} {path}")
                entry = measure(browser, storage, base, path, chart=chart, reps=args.reps)
                entry["group"] = group
                entry["load_average_1m"] = round(os.getloadavg()[0], 2)
                results["pages"][name] = entry
                if chart:
                    log(f"{name}: partial and full plotly bundles, paired, through the proxy")
                    paired = measure_paired(browser, storage, proxy, path, {
                        "partial bundle (as served)": lambda html: html, "full bundle": full_plotly}, args.reps)
                    paired["load_average_1m"] = round(os.getloadavg()[0], 2)
                    results["paired"][name] = paired
                    for variant, entry in paired["variants"].items():
                        entry["group"] = f"peer: {variant}, through the proxy"
                        results["pages"][f"{name} ({variant}, through the proxy)"] = entry
            browser.close()
        results["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
        out = args.result_json or HERE / f"results-{results['date']}.json"
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nmedian/p90 ms over {args.reps} reps; cold = fresh context, warm = loaded again in it")
        header = f"{'page':<58} {'kind':<5} " + " ".join(f"{m:>11}" for m in METRICS) + f" {'KB':>7}"
        print(header)
        for name, entry in results["pages"].items():
            for kind in ("cold", "warm"):
                kb = entry["summary"][kind].get("transfer_kb", {}).get("median")
                print(f"{name:<58} {kind:<5} " + " ".join(f"{cell(entry, kind, m):>11}" for m in METRICS)
                      + f" {kb if kb is not None else '-':>7}")
        print("\npaired, cold, median of (full bundle / partial bundle) per pair:")
        for name, paired in results["paired"].items():
            print(f"{name:<20} " + "  ".join(f"{m} {r}x" for m, r in paired["cold_ratio_median"].items()))
        print(f"\nwrote {out}; load average before {results['load_average_before']}, after "
              f"{results['load_average_after']}")
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        if not args.keep:
            from django.db import connections

            connections.close_all()
            recreate_scratch_database(admin_url, args.database, drop_only=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
