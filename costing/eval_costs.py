"""What an eval run cost, priced when it finishes (evals.signals.run_finished) into `EvalRun.usd`.

A run is priced one of two ways:
- Tokens at the list price, when the run scored a deployment (or a rollout's candidate, behind
  its deployment's route) that has a list price (its own, for every tenant) in effect when the
  run started: its prompt and completion tokens at that price, as a tenant would pay. The
  deployment's replicas serve live traffic meanwhile, so their time is not the run's to pay;
  its requests go to the replicas directly, so they are not in the usage ledger twice.
- Otherwise, the replica time the run held: for each replica it used, the time it ran within
  the run (started to finished) × the hourly price of what the replica holds (cpu, memory,
  GPUs: costing.ledger.replica_resources, priced by the price book at the run's start; a
  node's flat price is left out, being shared by whatever runs on the node). A version target
  is scored on a temporary replica started and stopped by the run (and so is a parity
  reference its deployment does not serve): the run's wall time is that replica's whole life,
  holding what the local driver gives it. A deployment without a list price is charged for
  each of its replicas of the scored version for the time they overlapped the run (the run
  spreads its cases over all of them): an upper bound, as they may have served others too.

A run that never started (cancelled while queued) cost nothing: $0. A run whose replicas hold
nothing the price book prices stays unpriced: usd null, never a made-up $0.
"""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from types import SimpleNamespace

from django.db.models import Q

from costing.ledger import RUNNING, Held, PriceBook, replica_resources
from costing.models import ListPrice
from deployments.choices import DriverName
from deployments.models import Deployment, Replica
from evals.choices import Scorer, TargetKind
from evals.models import EvalRun

log = logging.getLogger(__name__)

USD_PLACES = Decimal("0.000001")  # EvalRun.usd's decimal places
MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)
# The local driver runs a temporary replica with the run's engine arguments and no resources.
TEMPORARY = SimpleNamespace(resources={})


def run_deployment(run: EvalRun) -> Deployment | None:
    if run.rollout_id:
        return run.rollout.deployment
    return run.deployment


def list_price_at(deployment: Deployment, at: datetime) -> ListPrice | None:
    return (ListPrice.objects.filter(deployment=deployment.name, tenant="", effective_from__lte=at)
            .order_by("-effective_from").first())


def tokens_cost(run: EvalRun, price: ListPrice) -> Decimal:
    return (run.prompt_tokens * price.usd_per_mtok_prompt + run.completion_tokens * price.usd_per_mtok_completion) \
        / MILLION


def hourly_price(held: Held, book: PriceBook, at: datetime) -> Decimal | None:
    """What holding these resources costs per hour at `at`; None when the book prices none of them."""
    parts = [(f"gpu:{held.gpu_type}", held.gpu_count), ("cpu", held.cpus), ("memory", held.memory_gib)]
    priced = [(resource, amount) for resource, amount in parts if amount and book.has(resource)]
    if not priced:
        return None
    return sum((book.at(resource, at) * Decimal(amount) for resource, amount in priced), Decimal(0))


def replicas_used(run: EvalRun, deployment: Deployment) -> list[tuple[Replica, datetime, datetime]]:
    """The deployment's replicas of the scored version (a rollout's: its candidates) and the part
    of the run each ran for."""
    replicas = Replica.objects.filter(deployment=deployment, version=run.model_version, started_at__lt=run.finished_at)
    if run.rollout_id:
        replicas = replicas.filter(rollout=run.rollout)
    spans = []
    for replica in replicas.filter(Q(state__in=RUNNING) | Q(stopped_at__gt=run.started_at)):
        stopped = None if replica.state in RUNNING else replica.stopped_at
        spans.append((replica, max(replica.started_at, run.started_at), min(stopped or run.finished_at,
                                                                          run.finished_at)))
    return spans


def temporary_replicas(run: EvalRun, deployment: Deployment | None) -> list[dict]:
    """The engine arguments of each replica the run started for itself (as evals.runs.runner does):
    the target's for a version target, and the parity reference's, with the engine's defaults,
    when no replica of the target's deployment served the reference version."""
    started = [run.engine_args] if run.target_kind == TargetKind.VERSION else []
    parity = any(case.get("scorer") == Scorer.PARITY for case in run.set_version.items)
    if parity and run.reference_version_id and not (deployment and Replica.objects.filter(
            deployment=deployment, version=run.reference_version, started_at__lt=run.finished_at).exists()):
        started.append({})
    return started


def replica_time_cost(run: EvalRun, deployment: Deployment | None, book: PriceBook) -> Decimal | None:
    held: list[tuple[Held, datetime, datetime]] = []
    if deployment is not None and run.target_kind != TargetKind.VERSION:
        held += [(replica_resources(deployment, replica), start, end)
                 for replica, start, end in replicas_used(run, deployment)]
    held += [(replica_resources(TEMPORARY, SimpleNamespace(driver=DriverName.LOCAL, engine_args=engine_args)),
              run.started_at, run.finished_at) for engine_args in temporary_replicas(run, deployment)]
    rates = [(hourly_price(resources, book, run.started_at), start, end) for resources, start, end in held]
    if all(rate is None for rate, _, _ in rates):
        return None
    return sum((rate * Decimal(str((end - start).total_seconds())) / SECONDS_PER_HOUR
                for rate, start, end in rates if rate is not None and end > start), Decimal(0))


def run_cost(run: EvalRun, book: PriceBook | None = None) -> Decimal | None:
    """The run's cost in dollars (see the module's docstring for how), or None when unpriced."""
    if run.started_at is None or run.finished_at is None:
        return Decimal(0)
    deployment = run_deployment(run)
    price = list_price_at(deployment, run.started_at) if deployment is not None else None
    if price is not None:
        usd = tokens_cost(run, price)
    else:
        usd = replica_time_cost(run, deployment, book or PriceBook.load())
    return None if usd is None else usd.quantize(USD_PLACES, rounding=ROUND_HALF_EVEN)


def price_finished_run(sender, run: EvalRun, **kwargs) -> None:
    """run_finished's receiver: the run's usd, saved on its own (the runner's row is written already)."""
    run.usd = run_cost(run)
    EvalRun.objects.filter(pk=run.pk).update(usd=run.usd)
    log.info("eval run %s cost %s", run.pk, "unpriced" if run.usd is None else f"${run.usd}")
