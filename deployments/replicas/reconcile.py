"""The reconcile loop: make the replicas match what the deployment row says.

One pass per deployment, under a Postgres advisory lock so two workers (or a beat tick that
arrives while the last pass still runs) never act on the same deployment at once. Every pass is
idempotent: it reads the world (process alive? /health?), compares with the row, and takes the
next step — start what is missing, replace what failed (with exponential backoff and a
crash-loop flag), surge one new replica before draining an old one when the version changes,
drain and stop extras — then publishes the routing table.

Rows are written before processes are touched (a replica is STARTING before its process
exists), so a worker killed mid-pass leaves a row the next pass can finish, and the local
driver can re-adopt the process instead of starting a twin.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments.choices import ACTIVE_ROLLOUT, DeploymentStatus, ReplicaState, RolloutStatus, Strategy
from deployments.models import Deployment, Replica, ReplicaStart, Rollout
from deployments.replicas import routing
from deployments.replicas.drivers import DriverError, driver_for
from deployments.replicas.drivers.base import NoCapacity, ReplicaSpec
from deployments.rollouts import machine as rollout_machine
from deployments.rollouts import watch as rollout_watch
from inferops.locks import LockId, try_advisory_lock
from registry.checkpoint import CheckpointError, artifact_path

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Timings:
    """How patient the loop is. Settings override them (tests shorten them)."""

    start_timeout_s: float = 300
    health_timeout_s: float = 2
    health_failures_to_fail: int = 3
    # Between leaving the routing table and SIGTERM: gateways must see the new table first.
    routing_propagation_s: float = 3
    drain_timeout_s: float = 45
    backoff_base_s: float = 2
    backoff_max_s: float = 300
    crash_loop_after: int = 3
    # A replica that stays ready this long is healthy again: its failure count resets.
    stable_after_s: float = 60

    @classmethod
    def from_settings(cls) -> Timings:
        return cls(**getattr(settings, "INFEROPS_RECONCILE_TIMINGS", {}))


def backoff_s(failures: int, timings: Timings) -> float:
    """0 for the first failure (restart at once), then base, 2×base, 4×base ... up to max."""
    if failures <= 1:
        return 0
    return min(timings.backoff_base_s * 2 ** (failures - 2), timings.backoff_max_s)


@dataclass(frozen=True)
class Track:
    """A set of replicas of one spec: the stable one, a rollout's candidate, or a blue-green's old set."""

    name: str
    version_id: int
    engine_args: dict
    desired: int | None  # None: keep the ones there are, start none (an old set kept warm)
    weight: int | None  # percent of traffic; None: a share of what explicit weights leave, by ready replicas
    rollout_id: int | None = None  # set on the replicas it starts

    def matches(self, replica: Replica) -> bool:
        return replica.version_id == self.version_id and replica.engine_args == self.engine_args


def plan_tracks(deployment: Deployment, rollout: Rollout | None, now: datetime) -> list[Track]:
    """The stable track first, then a running rollout's candidate, the previous spec held back during a
    watch, or a blue-green's warm old set."""
    stable = Track("stable", deployment.version_id, deployment.engine_args, deployment.replicas, None)
    if rollout is not None:
        return [stable, Track("candidate", rollout.candidate_version_id, rollout.candidate_engine_args,
                              rollout_machine.candidate_size(rollout, deployment.replicas), rollout.weight, rollout.pk)]
    kept = (deployment.rollouts.filter(status=RolloutStatus.SUCCEEDED, strategy=Strategy.BLUE_GREEN,
                                       scale_down_at__gt=now).order_by("-id").first())
    if kept is not None and (kept.stable_version_id, kept.stable_engine_args) == (stable.version_id,
                                                                                   stable.engine_args):
        kept = None
    watched = rollout_watch.holdback(deployment, now)
    if watched is not None:
        # A blue-green's whole warm old set takes the holdback share; else the holdback's own replicas.
        desired = None if kept is not None and kept.pk == watched.pk else rollout_watch.holdback_replicas(
            watched, deployment.replicas)
        return [stable, Track("holdback", watched.stable_version_id, watched.stable_engine_args, desired,
                              watched.holdback_percent)]
    if kept is not None:
        return [stable, Track("previous", kept.stable_version_id, kept.stable_engine_args, None, 0)]
    return [stable]


def probe_health(url: str, timeout_s: float) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def replica_spec(deployment: Deployment, replica: Replica) -> ReplicaSpec:
    version = replica.version
    return ReplicaSpec(
        deployment=deployment.name,
        version=version.number,
        model_path=str(artifact_path(version.artifact_uri)),
        backend=deployment.backend,
        engine_args=replica.engine_args,
        resources=deployment.resources,
    )


class Reconciler:
    def __init__(self, deployment: Deployment, now: datetime | None = None, timings: Timings | None = None,
                 driver=None):
        self.deployment = deployment
        self.now = now or timezone.now()
        self.timings = timings or Timings.from_settings()
        self.driver = driver or driver_for(deployment.driver)
        self.replicas = list(
            deployment.replica_set.exclude(state=ReplicaState.STOPPED).select_related("version")
        )
        self.rollout: Rollout | None = None
        self.tracks = [Track("stable", deployment.version_id, deployment.engine_args, deployment.replicas, None)]

    # -- one pass ---------------------------------------------------------------------------

    def run(self) -> None:
        for replica in self.replicas:
            self.observe(replica)
        if self.deployment.deleted_at:
            self.drain_everything()
        elif not self.deployment.paused:
            self.rollout = self.advance_rollout()
            self.tracks = plan_tracks(self.deployment, self.rollout, self.now)
            self.converge()
            self.start_due()
        self.replicas = [r for r in self.replicas if r.state != ReplicaState.STOPPED]
        self.update_status()
        self.publish()

    # -- observing ----------------------------------------------------------------------------

    def save(self, replica: Replica, *fields: str) -> None:
        replica.save(update_fields=[*fields, "updated_at"])

    def fail(self, replica: Replica, reason: str) -> None:
        if replica.state == ReplicaState.STARTING:
            latest_start_of(replica).update(failed=True)
        replica.state = ReplicaState.FAILED
        replica.consecutive_failures += 1
        replica.crash_looping = replica.consecutive_failures >= self.timings.crash_loop_after
        replica.not_before = self.now + timedelta(seconds=backoff_s(replica.consecutive_failures, self.timings))
        tail = self.driver.log_tail(replica, lines=5).strip().splitlines()
        replica.last_error = reason + (f" — last log line: {tail[-1][:500]}" if tail else "")
        replica.last_health_ok = False
        self.save(replica, "state", "consecutive_failures", "crash_looping", "not_before", "last_error",
                  "last_health_ok", "identity")
        log.warning("replica %s failed: %s", replica, reason)

    def check_health(self, replica: Replica) -> bool:
        healthy = probe_health(replica.url, self.timings.health_timeout_s)
        failures = 0 if healthy else replica.identity.get("health_failures", 0) + 1
        replica.identity = {**replica.identity, "health_failures": failures}
        replica.last_health_at = self.now
        replica.last_health_ok = healthy
        self.save(replica, "identity", "last_health_at", "last_health_ok")
        return healthy

    def observe(self, replica: Replica) -> None:
        state = replica.state
        if state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING):
            if not replica.identity.get("pid") and hasattr(self.driver, "adopt"):
                # Started by a worker that died before it could save the pid.
                if self.driver.adopt(replica):
                    self.save(replica, "identity", "url", "port", "log_path")
            alive = self.driver.is_alive(replica)
        else:
            return
        if state == ReplicaState.DRAINING:
            self.observe_draining(replica, alive)
        elif not alive:
            # How it ended stays on the row (and the page) after the restart: a death is never silent.
            ended = self.driver.exit_status(replica)
            self.fail(replica, f"process exited: {ended}" if state == ReplicaState.READY
                      else f"process exited while starting: {ended}")
        elif state == ReplicaState.STARTING:
            if self.check_health(replica):
                replica.state = ReplicaState.READY
                replica.ready_at = self.now
                # The start's phase ends when /health answered, which may be well into a pass that
                # probed other replicas first (never before the pass's own time, which tests set).
                answered = max(self.now, timezone.now())
                with transaction.atomic():
                    self.save(replica, "state", "ready_at")
                    latest_start_of(replica).filter(ready_at__isnull=True).update(ready_at=answered)
            elif (self.now - replica.started_at).total_seconds() > self.timings.start_timeout_s:
                reason = f"not ready {self.timings.start_timeout_s:.0f}s after start"
                self.driver.kill(replica, why=reason)
                self.fail(replica, reason)
        else:  # READY
            if self.check_health(replica):
                ready_for = (self.now - replica.ready_at).total_seconds() if replica.ready_at else 0
                stable = ready_for > self.timings.stable_after_s
                if stable and replica.consecutive_failures:
                    replica.consecutive_failures = 0
                    replica.crash_looping = False
                    self.save(replica, "consecutive_failures", "crash_looping")
            elif replica.identity["health_failures"] >= self.timings.health_failures_to_fail:
                reason = f"/health failed {replica.identity['health_failures']} times in a row"
                self.driver.kill(replica, why=reason)
                self.fail(replica, reason)

    def observe_draining(self, replica: Replica, alive: bool) -> None:
        if not alive:
            ended = self.driver.exit_status(replica)
            # A drained replica exits 0; anything else is worth keeping on its row.
            self.mark_stopped(replica, error="" if "exited with code 0" in ended else f"process exited: {ended}")
            return
        since = (self.now - replica.draining_since).total_seconds()
        sigterm_at = replica.identity.get("sigterm_at")
        if sigterm_at is None and since >= self.timings.routing_propagation_s:
            self.driver.stop(replica, grace_s=self.timings.drain_timeout_s, why="drain")
            replica.identity = {**replica.identity, "sigterm_at": self.now.timestamp()}
            self.save(replica, "identity")
        elif sigterm_at is not None and self.now.timestamp() - sigterm_at > self.timings.drain_timeout_s:
            reason = f"did not drain within {self.timings.drain_timeout_s:.0f}s of SIGTERM"
            self.driver.kill(replica, why=reason)
            self.mark_stopped(replica, error=f"{reason}; killed")

    # -- acting -------------------------------------------------------------------------------

    def mark_stopped(self, replica: Replica, error: str = "") -> None:
        replica.state = ReplicaState.STOPPED
        replica.stopped_at = self.now
        fields = ["state", "stopped_at", "identity"]
        if error:
            replica.last_error = error
            fields.append("last_error")
        self.save(replica, *fields)

    def drain(self, replica: Replica) -> None:
        """Ready replicas leave the routing table first and get SIGTERM later; others stop now."""
        if replica.state == ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            replica.draining_since = self.now
            self.save(replica, "state", "draining_since")
        elif replica.state in (ReplicaState.STARTING, ReplicaState.PENDING, ReplicaState.FAILED):
            if replica.state == ReplicaState.STARTING:
                self.driver.kill(replica, why="no longer wanted while starting")
            self.mark_stopped(replica)

    def drain_everything(self) -> None:
        for replica in self.replicas:
            if replica.state != ReplicaState.DRAINING:
                self.drain(replica)

    def advance_rollout(self) -> Rollout | None:
        """Let the running rollout take its due transitions, given its candidate's replicas; first the
        watch after a success, which may start a rollback that this pass then advances."""
        rollout_watch.watch(self.deployment, self.now)
        rollout = self.deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
        if rollout is None:
            return None
        candidate = Track("candidate", rollout.candidate_version_id, rollout.candidate_engine_args, None, None)
        mine = [r for r in self.replicas if candidate.matches(r)]
        ready = sum(r.state == ReplicaState.READY for r in mine)
        looping = [r for r in mine if r.crash_looping]
        failure = looping[0].last_error if looping and len(looping) * 2 >= max(len(mine), 1) else ""
        state = rollout_machine.CandidateState(ready=ready, failure=failure)
        return rollout_machine.advance(self.deployment, state, self.now)

    def new_replica(self, track: Track) -> Replica:
        replica = Replica.objects.create(
            deployment=self.deployment, version_id=track.version_id, driver=self.deployment.driver,
            node=getattr(self.driver, "node", "") or _node_name(self.deployment.driver),
            engine_args=track.engine_args, state=ReplicaState.PENDING, rollout_id=track.rollout_id,
        )
        replica.version  # noqa: B018 - load it now: the spec and the routing table read its number
        self.replicas.append(replica)
        return replica

    def track_of(self, replica: Replica) -> Track | None:
        return next((track for track in self.tracks if track.matches(replica)), None)

    def converge(self) -> None:
        live = [r for r in self.replicas if r.state in (ReplicaState.PENDING, ReplicaState.STARTING,
                                                         ReplicaState.READY, ReplicaState.FAILED)]
        # Spec drift: a replica of no track (another version, other engine args) is outdated.
        outdated = [r for r in live if self.track_of(r) is None]
        # Outdated replicas that serve nothing go at once, and so does an aborted rollout's
        # candidate (traffic leaves it now); other ready ones wait for their replacement.
        aborted = set(Rollout.objects.filter(pk__in={r.rollout_id for r in outdated if r.rollout_id},
                                             status=RolloutStatus.ABORTED).values_list("pk", flat=True))
        for replica in [r for r in outdated if r.state != ReplicaState.READY or r.rollout_id in aborted]:
            self.drain(replica)
        outdated_ready = [r for r in outdated if r.state == ReplicaState.READY and r.rollout_id not in aborted]
        stable, *others = self.tracks
        self.scale_track(stable, [r for r in live if stable.matches(r)], outdated_ready)
        for track in others:
            if track.desired is not None:
                self.scale_track(track, [r for r in live if track.matches(r)], [])

    def scale_track(self, track: Track, current: list[Replica], outdated_ready: list[Replica]) -> None:
        desired = track.desired
        if outdated_ready:
            # Surge one: never more than desired + 1 live replicas during a replacement.
            room = desired + 1 - len(current) - len(outdated_ready)
            for _ in range(max(0, min(room, desired - len(current)))):
                current.append(self.new_replica(track))
            ready_current = sum(r.state == ReplicaState.READY for r in current)
            excess = ready_current + len(outdated_ready) - desired
            for replica in outdated_ready[:max(0, excess)]:
                self.drain(replica)
            return
        for _ in range(desired - len(current)):
            current.append(self.new_replica(track))
        if len(current) > desired:
            # Drop the least useful first: not yet started, then failing, then the newest ready.
            order = {ReplicaState.PENDING: 0, ReplicaState.FAILED: 1, ReplicaState.STARTING: 2,
                     ReplicaState.READY: 3}
            extras = sorted(current, key=lambda r: (order[r.state], -r.pk))[: len(current) - desired]
            for replica in extras:
                self.drain(replica)

    def start_due(self) -> None:
        for replica in self.replicas:
            if replica.state not in (ReplicaState.PENDING, ReplicaState.FAILED):
                continue
            track = self.track_of(replica)
            if track is None or track.desired is None:
                continue
            if replica.not_before and replica.not_before > self.now:
                continue
            self.start(replica)

    def start_cause(self, replica: Replica) -> str:
        """Why this start: replacing a failed process (or one that waited for capacity since), the
        first of a deployment with nothing ready, or one more beside ready ones."""
        if replica.state == ReplicaState.FAILED or replica.restarts:
            return "restart"
        if not any(r.state == ReplicaState.READY for r in self.replicas):
            return "from_zero"
        return "scale"

    def start(self, replica: Replica) -> None:
        cause = self.start_cause(replica)
        if replica.state == ReplicaState.FAILED:
            replica.restarts += 1
        replica.state = ReplicaState.STARTING
        replica.started_at = self.now
        replica.ready_at = None
        replica.identity = {}
        # The start's row with the replica's: a worker killed before the process exists leaves both,
        # and the next pass fails the start it cannot adopt.
        with transaction.atomic():
            self.save(replica, "state", "started_at", "ready_at", "identity", "restarts")
            record = ReplicaStart.objects.create(replica=replica, deployment=self.deployment,
                                                 version_id=replica.version_id, cause=cause, started_at=self.now)
        try:
            started = self.driver.start(replica, replica_spec(self.deployment, replica))
        except NoCapacity as exc:  # waiting is no failure: no backoff growth, no crash loop
            replica.state, replica.started_at, replica.last_error = ReplicaState.PENDING, None, f"waiting: {exc}"
            replica.not_before = self.now + timedelta(seconds=self.timings.backoff_base_s)
            with transaction.atomic():
                self.save(replica, "state", "started_at", "last_error", "not_before")
                record.delete()  # no start happened: waiting is not a cold start
            return
        except (DriverError, CheckpointError) as exc:
            self.fail(replica, f"could not start: {exc}")
            return
        replica.url, replica.port, replica.log_path = started.url, started.port, started.log_path
        replica.identity = started.identity
        if replica.last_error.startswith("waiting: "):
            replica.last_error = ""  # it got what it waited for
        self.save(replica, "url", "port", "log_path", "identity", "last_error")

    # -- reporting ----------------------------------------------------------------------------

    def update_status(self) -> None:
        deployment = self.deployment
        if deployment.deleted_at:
            return
        target = [r for r in self.replicas if self.tracks[0].matches(r)]
        ready = sum(r.state == ReplicaState.READY for r in target)
        outdated = [r for r in self.replicas if self.track_of(r) is None and r.state != ReplicaState.DRAINING]
        crash_looping = [r for r in target if r.crash_looping]
        if deployment.paused:
            status, message = DeploymentStatus.PAUSED, "Reconciliation paused by an operator."
        elif crash_looping and ready == 0:
            status = DeploymentStatus.FAILED
            message = f"{len(crash_looping)} replica(s) crash-looping: {crash_looping[0].last_error}"
        elif crash_looping:
            status = DeploymentStatus.DEGRADED
            message = f"{len(crash_looping)} replica(s) crash-looping: {crash_looping[0].last_error}"
        elif self.rollout is not None:
            status = DeploymentStatus.PROGRESSING
            message = (f"Rollout {self.rollout.pk} {self.rollout.status}: {self.rollout.weight}% on "
                       f"v{self.rollout.candidate_version.number}. {self.rollout.message}").strip()
        elif deployment.replicas == 0 and deployment.autoscale and deployment.min_replicas == 0 and not (
                target or outdated):
            status = DeploymentStatus.PARKED
            message = "Scaled to zero; the gateway holds the next request while a replica starts."
        elif ready >= deployment.replicas and not outdated:
            status, message = DeploymentStatus.READY, ""
        elif ready == 0 and not outdated:
            status, message = DeploymentStatus.PENDING, "Waiting for replicas to become ready."
        else:
            status = DeploymentStatus.PROGRESSING
            message = f"{ready}/{deployment.replicas} replicas of v{deployment.version.number} ready"
        if (status, message) != (deployment.status, deployment.status_message):
            Deployment.objects.filter(pk=deployment.pk).update(status=status, status_message=message)
            deployment.status, deployment.status_message = status, message

    def publish(self) -> None:
        if self.deployment.deleted_at:
            return
        ready = [r for r in self.replicas if r.state == ReplicaState.READY]
        groups: dict[tuple[str, int], list[Replica]] = {}
        for replica in ready:
            track = self.track_of(replica)
            groups.setdefault((track.name if track else "outdated", replica.version.number), []).append(replica)
        weights = {track.name: track.weight for track in self.tracks}
        routing.publish(routing.routing_entry(self.deployment, [
            (name, number, weights.get(name), replicas) for (name, number), replicas in groups.items()]))
        preview = routing.preview_name(self.deployment.name)
        candidates = groups.get(("candidate", self.rollout.candidate_version.number), []) if self.rollout else []
        if candidates:
            routing.publish(routing.routing_entry(
                self.deployment, [("candidate", candidates[0].version.number, 100, candidates)], name=preview))
        elif routing.is_published(preview):
            routing.unpublish(preview)


def latest_start_of(replica: Replica):
    """The replica's latest start, as a queryset of one row to update."""
    return ReplicaStart.objects.filter(pk__in=replica.starts.order_by("-started_at", "-id").values("pk")[:1])


def _node_name(driver: str) -> str:
    if driver == "local":
        from deployments.replicas.drivers.local import node_name

        return node_name()
    return getattr(settings, "INFEROPS_K8S_NAMESPACE", "inferops")


def reconcile_deployment(deployment_id: int, now: datetime | None = None) -> str:
    """One reconcile pass; returns what happened ("locked", "gone", "deleted", "ok")."""
    with try_advisory_lock(LockId.RECONCILE, deployment_id) as acquired:
        if not acquired:
            return "locked"
        deployment = Deployment.objects.select_related("version", "model").filter(pk=deployment_id).first()
        if deployment is None:
            return "gone"
        reconciler = Reconciler(deployment, now=now)
        reconciler.run()
        if deployment.deleted_at and not reconciler.replicas:
            with transaction.atomic():
                routing.unpublish(deployment.name)
                if routing.is_published(routing.preview_name(deployment.name)):
                    routing.unpublish(routing.preview_name(deployment.name))
                deployment.delete()
            return "deleted"
        return "ok"
