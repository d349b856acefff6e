"""`inferops run`: the whole platform in one terminal, on embedded defaults.

Starts (or reuses) Postgres and Redis, migrates, creates the first admin, then runs the web
app under uvicorn, a Celery worker and Celery beat as child processes. Ctrl-C stops every
process it started, then the embedded servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from project import embedded

STOP_GRACE_S = 15
# The summary of where things are comes back this often (and on SIGUSR1), so the log never buries it.
BANNER_EVERY_S = 600


# A child that exits by itself is started again, as compose's `restart: unless-stopped` and Kubernetes
# do (a Celery worker exits when Redis drops under it at the wrong moment); one that keeps exiting
# stops everything instead of looping.
RESTARTS_ALLOWED, RESTART_WINDOW_S = 5, 300


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    exits: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=os.environ.copy())

    def restart_after_exit(self, now: float) -> bool:
        """Start again after an exit of its own, unless it exited RESTARTS_ALLOWED times in RESTART_WINDOW_S."""
        self.exits = [at for at in self.exits if now - at < RESTART_WINDOW_S] + [now]
        if len(self.exits) > RESTARTS_ALLOWED:
            return False
        self.start()
        return True


def add_arguments(parser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="web app address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="web app port (default 8000)")
    parser.add_argument("--gateway-port", type=int, default=8080, help="API gateway port (default 8080)")
    parser.add_argument("--worker-concurrency", type=int, default=2)
    parser.add_argument("--batch-concurrency", type=int, default=2,
                        help="offline batches run at once by the batch worker (default 2; the rest queue)")


def external_url(host: str, port: int) -> str:
    """The console's address as links in alerts and notifications should name it: the host and port
    it was started on (a wildcard address names this machine)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """Where a process on this machine reaches the web app: a wildcard address through loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def password_lines(password: str | None) -> list[str]:
    """How to log in, naming the password file (bootstrap.save_admin_password) while it exists."""
    from project.bootstrap import PASSWORD_FILE

    path = embedded.data_dir() / PASSWORD_FILE
    if password:
        return [f"  log in as 'admin' with password {password}   (also in {path}, readable only by you)"]
    if path.is_file():
        return [f"  log in as 'admin': the password made on the first run is in {path}"]
    return ["  log in with your existing admin user"]


def banner(*, console: str, gateway: str, demo_key: str | None, login: list[str]) -> str:
    """Where the console, the API and the logs are, and how to log in and call the demo: printed at
    start, again every BANNER_EVERY_S and when the launcher gets SIGUSR1."""
    key = demo_key or "shown on the first run only; create another on the Tenants page"
    rule = "-" * 72
    return "\n".join([
        "", rule,
        "inferops is running:",
        f"  console   {console}/",
        f"  REST API  {console}/api/v1/   (OpenAPI schema {console}/api/schema/, docs {console}/api/docs/)",
        f"  health    {console}/healthz",
        f"  gateway   {gateway}/v1   (OpenAI-compatible; API keys from Tenants)",
        f"  demo key  {key}",
        *login,
        f"  logs      this terminal (web, gateway, worker, beat); replicas in {embedded.data_dir() / 'replicas'}",
        f"  this summary repeats every {BANNER_EVERY_S // 60} min; `kill -USR1 {os.getpid()}` prints it now",
        rule, "",
    ])


class BannerRepeat:
    """When the banner is due again: `every_s` after it was last shown, or at once when asked."""

    def __init__(self, every_s: float, now: float) -> None:
        self.every_s = every_s
        self.next_at = now + every_s
        self.asked = False

    def ask(self) -> None:
        self.asked = True  # from a signal handler: the main loop prints, not the handler

    def due(self, now: float) -> bool:
        if not self.asked and now < self.next_at:
            return False
        self.asked = False
        self.next_at = now + self.every_s
        return True


def prepare() -> tuple[str | None, str | None]:
    """Migrate and bootstrap in this process; returns the admin password and the demo API key,
    each only when it was just created (they are shown once)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)
    from project.bootstrap import ensure_admin, ensure_demo, ensure_demo_tenant, save_admin_password

    password = ensure_admin()
    if password:
        save_admin_password(embedded.data_dir(), password)
    if ensure_demo(embedded.data_dir()):
        print("Created the demo model and its `demo` deployment (1 replica).", flush=True)
    return password, ensure_demo_tenant()


def demo_instructions(gateway: str, key: str | None) -> str:
    shown = key or "<your demo key: shown once on the first run; create another on the Tenants page>"
    return (
        f"\nCall the demo deployment through the gateway ({gateway}/v1):\n"
        f"  curl -N {gateway}/v1/chat/completions -H 'Authorization: Bearer {shown}' \\\n"
        f"       -H 'Content-Type: application/json' -d '{{\"model\": \"demo\", \"stream\": true, "
        f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 32}}'\n"
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{gateway}/v1', api_key='{shown}'); "
        f"[print(x.choices[0].delta.content or '', end='', flush=True) for x in c.chat.completions.create("
        f"model='demo', messages=[{{'role': 'user', 'content': 'Hello'}}], max_tokens=32, stream=True) "
        f"if x.choices]\"\n"
    )


def announce_demo_replica(stopping, instructions: str, timeout_s: float = 300, login: tuple[str, ...] = ()) -> None:
    """Print how to call the demo replica once it is ready (the reconcile loop starts it), and how to
    log in again: that is the end of start-up, below the workers' first logs."""
    from deployments.choices import ReplicaState
    from deployments.models import Deployment

    deadline = time.monotonic() + timeout_s
    while not stopping() and time.monotonic() < deadline:
        deployment = Deployment.objects.filter(name="demo").first()
        replica = deployment and deployment.replica_set.filter(state=ReplicaState.READY).first()
        if replica:
            print(
                f"\nThe demo deployment is ready: replica {replica.url}\n"
                f"  curl {replica.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                f"       -d '{{\"model\": \"demo\", \"messages\": [{{\"role\": \"user\", "
                f"\"content\": \"Hello\"}}], \"max_tokens\": 32}}'\n" + instructions + "\n".join(login),
                flush=True,
            )
            return
        time.sleep(1)


def children(args) -> list[Child]:
    python = sys.executable
    beat_schedule = embedded.data_dir() / "celerybeat-schedule"
    return [
        Child("web", [python, "-m", "uvicorn", "project.asgi:application", "--host", args.host,
                      "--port", str(args.port), "--no-access-log"]),
        # The gateway forwards the Files and Batches API to the web app it runs beside.
        Child("gateway", [python, "-m", "project.cli", "gateway", "--host", args.host,
                          "--port", str(args.gateway_port),
                          "--spool-dir", str(embedded.data_dir() / "gateway-spool"),
                          "--control-plane-url", local_url(args.host, args.port)]),
        Child("worker", [python, "-m", "celery", "-A", "inferops.celery", "worker", "--loglevel", "INFO",
                         "--concurrency", str(args.worker_concurrency), "--hostname", "worker@%h"]),
        # Batch runners hold their slot for a whole batch: a worker of their own (docs/batches.md).
        Child("batch-worker", [python, "-m", "celery", "-A", "inferops.celery", "worker", "--loglevel", "INFO",
                               "--queues", "batches", "--concurrency", str(args.batch_concurrency),
                               "--hostname", "batches@%h"]),
        Child("beat", [python, "-m", "celery", "-A", "inferops.celery", "beat", "--loglevel", "INFO",
                       "--schedule", str(beat_schedule)]),
    ]


def stop_all(started: list[Child]) -> None:
    for child in started:
        if child.process and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in started:
        if not child.process:
            continue
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def stop_local_replicas() -> int:
    """Replicas run in their own sessions (they outlive a worker restart); Ctrl-C on `inferops
    run` means stop everything, so drain this node's replicas and mark them stopped."""
    from django.utils import timezone

    from deployments.choices import ReplicaState
    from deployments.models import Replica
    from deployments.replicas.drivers.local import LocalProcessDriver, node_name

    driver = LocalProcessDriver()
    replicas = list(Replica.objects.filter(driver="local", node=node_name()).exclude(state=ReplicaState.STOPPED))
    for replica in replicas:
        driver.stop(replica, why="inferops run is stopping")
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(driver.is_alive(r) for r in replicas):
        time.sleep(0.2)
    for replica in replicas:
        if driver.is_alive(replica):
            driver.kill(replica, why="did not drain before inferops run stopped")
    Replica.objects.filter(pk__in=[r.pk for r in replicas]).update(
        state=ReplicaState.STOPPED, stopped_at=timezone.now(), last_error="stopped with inferops run")
    return len(replicas)


def main(args) -> int:
    # Before Django reads its settings here and in the children: alert links name this console.
    os.environ.setdefault("INFEROPS_EXTERNAL_URL", external_url(args.host, args.port))
    exported = embedded.ensure_services()
    if exported:
        print(f"Embedded Postgres and Redis under {embedded.data_dir()} "
              f"({', '.join(sorted(exported))} not set).", flush=True)
    password, demo_key = prepare()
    started: list[Child] = []
    stopping = False
    crashed: Child | None = None

    def request_stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    repeat = BannerRepeat(BANNER_EVERY_S, time.monotonic())
    signal.signal(signal.SIGUSR1, lambda signum, frame: repeat.ask())
    try:
        for child in children(args):
            child.start()
            started.append(child)
        base = f"http://{args.host}:{args.port}"
        gateway = f"http://{args.host}:{args.gateway_port}"
        login = password_lines(password)
        summary = banner(console=base, gateway=gateway, demo_key=demo_key, login=login)
        print(summary + "Press Ctrl-C to stop everything.\n", flush=True)
        threading.Thread(target=announce_demo_replica, args=(lambda: stopping, demo_instructions(gateway, demo_key)),
                         kwargs={"login": ("", *login)}, daemon=True).start()
        while not stopping:
            for child in started:
                if child.process.poll() is not None and not stopping:
                    code = child.process.returncode
                    if child.restart_after_exit(time.monotonic()):
                        print(f"{child.name} exited with code {code}; started it again.", flush=True)
                        continue
                    print(f"{child.name} exited with code {code}, {RESTARTS_ALLOWED + 1} times in "
                          f"{RESTART_WINDOW_S // 60} minutes; stopping.", flush=True)
                    crashed = child
                    stopping = True
                    break
            if not stopping and repeat.due(time.monotonic()):
                print(summary, flush=True)
            time.sleep(0.5)
    finally:
        print("Stopping...", flush=True)
        stop_all(started)
        stopped = stop_local_replicas()
        if stopped:
            print(f"Stopped {stopped} replica(s).", flush=True)
    return 1 if crashed else 0
