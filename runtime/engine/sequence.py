"""One generated sequence's state: its tokens, how many have KV computed, its block table."""

from __future__ import annotations

import enum
from itertools import count

_next_seq_id = count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens of one of the `n` outputs of a request, and where their KV lives.

    `num_computed_tokens` counts tokens whose keys/values are in the cache; everything from
    there to the end of `token_ids` still has to go through the model (a prompt, a prompt's
    remaining chunk, the last sampled token, or everything again after a preemption).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        index: int = 0,
        priority: int = 0,
        arrival: int = 0,
        max_tokens: int = 16,
        arrival_time: float = 0.0,
        ttft_deadline: float | None = None,
        tpot_target: float | None = None,
    ) -> None:
        self.seq_id = next(_next_seq_id)
        self.request_id = request_id
        self.index = index
        self.priority = priority
        self.arrival = arrival
        self.max_tokens = max_tokens
        # SLO scheduling (runtime/engine/slo_scheduling.py): clock seconds.
        self.arrival_time = arrival_time
        self.ttft_deadline = ttft_deadline
        self.tpot_target = tpot_target
        self.first_token_time: float | None = None
        self.late = False  # can no longer make its TTFT: served after those that can
        self.slack = 0.0  # seconds, as of the last plan
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.was_admitted = False
        # Logits wanted at every prompt position (prompt logprobs): the prompt is computed,
        # never taken from the prefix cache, until they are in.
        self.needs_prompt_logits = False
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def schedule_key(self) -> tuple[int, int, int]:
        """Sort key: higher priority first, then first come first served."""
        return (-self.priority, self.arrival, self.seq_id)

    def append_token(self, token_id: int, now: float | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = now if now is not None else self.arrival_time
        self.token_ids.append(token_id)
