"""The usage pipeline's folds: every consumer of usage events folds each new batch in the ingest transaction.

Usage events are read once, from the stream, by ingestion (tenants/ingest.py). A batch's events
that were new (not a replay or duplicate: request ids already stored add nothing) go, in the same
transaction that stores them, into the per-minute aggregates: the tenant usage ledger (tenants),
and those of the apps that register a fold here in their AppConfig.ready (slo, costing). The
registry lives in the core because slo and tenants are side by side: neither may import the other.
Each fold adds into its own rows by event time (`x = x + n`), so a late event is counted exactly
in its own minute, and a failed batch adds nothing anywhere (it is redone whole).

Folds run in stage order: JUDGE folds (SLO verdicts) before AGGREGATE folds, which may read
what a judge set on the events (`slo_compliant`) instead of judging again.
"""

from __future__ import annotations

from collections.abc import Callable

# A fold gets the open psycopg cursor of the ingest transaction and the batch's new events (the
# parsed dicts of tenants.ingest.parse_event, `time` in epoch seconds).
Fold = Callable[[object, list[dict]], None]
JUDGE, AGGREGATE = 0, 1

_folds: list[tuple[int, str, Fold]] = []


def register(fold: Fold, *, stage: int = AGGREGATE) -> None:
    """Add a fold (once per function: AppConfig.ready may run again in tests)."""
    name = f"{fold.__module__}.{fold.__qualname__}"
    if any(known == name for _, known, _ in _folds):
        return
    _folds.append((stage, name, fold))
    _folds.sort(key=lambda item: item[0])


def fold(cursor, events: list[dict]) -> None:
    """Run every registered fold over the batch's new events, in stage order."""
    if not events:
        return
    for _, _, each in _folds:
        each(cursor, events)
