"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy (as in vLLM): dividing by ~0 only breaks ties badly.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class Sampler:
    """Picks one token per row of logits; each row has its own params and generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[int]:
        # numpy's argmax (SIMD, same first-maximum tie rule) is ~10x faster than torch's on CPU
        # for a step's [rows, vocabulary] logits: 0.16 vs 1.6 ms at 64 rows of 30,522.
        token_ids = logits.numpy().argmax(axis=1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return token_ids
        rows = torch.tensor(random_rows)
        row_params = [params[i] for i in random_rows]
        probs = self.probabilities(logits[rows].float(), row_params)
        for j, i in enumerate(random_rows):
            token_ids[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
        return token_ids

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits after top-k and top-p filtering, per row."""
        vocab = logits.shape[-1]
        temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        logits = logits / temperatures.unsqueeze(1)
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(top_ks) < vocab:
            top_values = logits.topk(max(top_ks), dim=-1).values
            kth = top_values.gather(1, torch.tensor(top_ks).unsqueeze(1) - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        if bool((top_ps < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            drop = mass_before >= top_ps.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)
