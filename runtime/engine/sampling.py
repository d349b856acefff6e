"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds); what
changes a row's logits before it (logit bias, the tokens min_tokens bans, the repetition,
frequency and presence penalties, min_p); and per-token logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from runtime.engine.config import MAX_ADDITIVE_PENALTY, MAX_LOGIT_BIAS, MAX_LOGPROBS

# Below this temperature sampling is greedy (as in vLLM): dividing by ~0 only breaks ties badly.
GREEDY_TEMPERATURE = 1e-5
# What the sampler returns for a row it cannot pick from: a NaN or +inf logit (broken weights,
# or an overflow in a low-precision dtype) or no finite logit at all. The engine fails that
# request alone instead of letting one bad row end the step for everyone.
INVALID_TOKEN = -1


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    # Keep only tokens at least this likely relative to the most likely one (0 = off).
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    # Penalties, as vLLM applies them: repetition divides a positive logit (multiplies a
    # negative one) of every token already in the prompt or the output; frequency subtracts
    # its weight times a token's count in the output; presence subtracts it once per token
    # the output holds.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # None: no logprobs; k: each sampled token's logprob and the k most likely alternatives'.
    logprobs: int | None = None
    # The same for each prompt token after the first (what the model predicted there).
    prompt_logprobs: int | None = None
    # Added to a token's logit before the penalties (OpenAI's logit_bias), by token id.
    logit_bias: dict[int, float] | None = None
    # Until this many tokens are out, EOS and stop_token_ids cannot be sampled and stop
    # strings do not end the output (vLLM's min_tokens).
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # NaN too: it reached the sampler and stopped the engine loop
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_ADDITIVE_PENALTY <= getattr(self, name) <= MAX_ADDITIVE_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ADDITIVE_PENALTY}, "
                                 f"{MAX_ADDITIVE_PENALTY}], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], "
                             f"got {self.min_tokens}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map token ids >= 0 to values in "
                                 f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {token_id}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@torch.inference_mode()  # the runner's logits are inference tensors, changed in place here
def apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                    prompts: list[torch.Tensor], outputs: list[list[int]]) -> None:
    """Penalise, in place, logits row `rows[i]` by `params[i]`, whose sequence's distinct
    prompt token ids are `prompts[i]` and whose output so far is `outputs[i]`.

    The order and arithmetic are vLLM's, and the repetition penalty is transformers'
    RepetitionPenaltyLogitsProcessor (greedy output with it is tested against transformers).
    Only the logits of tokens a row has seen are read and written, all rows at once, by their
    index in the flattened logits: vLLM counts tokens over a dense [rows, vocabulary] table,
    which costs a pass over the whole vocabulary per row."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    num_rows = logits.shape[0]
    per_row = torch.zeros(3, num_rows)  # repetition, frequency, presence by logits row
    per_row[0] = 1.0
    per_row[:, rows] = torch.tensor([[p.repetition_penalty for p in params],
                                     [p.frequency_penalty for p in params],
                                     [p.presence_penalty for p in params]])
    bases = [row * vocab for row in rows]
    # Each output token's index in `flat`; numpy reads the lists 4x faster than torch.tensor.
    lengths = np.fromiter(map(len, outputs), np.int64, len(outputs))
    tokens = np.fromiter(chain.from_iterable(outputs), np.int64, int(lengths.sum()))
    output_keys = torch.from_numpy(tokens + np.repeat(np.asarray(bases, np.int64), lengths)).to(logits.device)
    repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeating:
        # A token seen twice is read twice and written twice with the same value, so the keys
        # need no deduplication (a sort).
        keys = torch.cat([prompts[i].to(logits.device) + bases[i] for i in repeating] + [output_keys])
        penalty = per_row[0][keys // vocab]
        scores = flat[keys]
        flat[keys] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if len(output_keys) and any(p.frequency_penalty or p.presence_penalty for p in params):
        keys, counts = output_keys.unique(return_counts=True)
        owner = keys // vocab
        flat[keys] = (flat[keys] - per_row[1][owner] * counts) - per_row[2][owner]


@torch.inference_mode()
def apply_logit_bias(logits: torch.Tensor, rows: list[int],
                     biases: list[dict[int, float]]) -> None:
    """Add, in place, `biases[i]` (token id -> bias) to logits row `rows[i]`."""
    vocab = logits.shape[-1]
    keys = [row * vocab + token_id for row, bias in zip(rows, biases, strict=True)
            for token_id in bias]
    values = [value for bias in biases for value in bias.values()]
    logits.view(-1).index_add_(0, torch.tensor(keys, dtype=torch.long),
                               torch.tensor(values, dtype=logits.dtype))


@torch.inference_mode()
def apply_min_p(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """Drop, in place, the tokens of logits row `rows[i]` less likely than `params[i].min_p`
    times its most likely token at its temperature, before top-k and top-p, as vLLM does:
    p / p_max >= min_p is logit >= max logit + temperature * log(min_p)."""
    selected = torch.tensor(rows)
    values = logits[selected]
    scale = torch.tensor([[p.temperature * math.log(p.min_p)] for p in params])
    values.masked_fill_(values < values.amax(dim=-1, keepdim=True) + scale, -torch.inf)
    logits[selected] = values


@torch.inference_mode()
def ban_tokens(logits: torch.Tensor, rows: list[int], banned: list[list[int]]) -> None:
    """Make, in place, the tokens `banned[i]` impossible in logits row `rows[i]`."""
    vocab = logits.shape[-1]
    keys = [row * vocab + token_id for row, ids in zip(rows, banned, strict=True) for token_id in ids]
    logits.view(-1)[torch.tensor(keys, dtype=torch.long)] = -torch.inf


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and its `top` most likely alternatives (id, logprob), most
    likely first, from the model's own distribution: the log-softmax of the raw logits, before
    penalties, temperature and top-k / top-p, as vLLM reports them by default. A prompt's
    first token has none (`logprob` None): nothing came before it to predict it."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int],
                   counts: list[int]) -> list[TokenLogprob]:
    """Per row of `logprobs` (a log-softmax: torch's fused one is faster here than a logit
    minus its row's logsumexp), the row's token and its `counts[row]` most likely
    alternatives."""
    chosen = logprobs.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1)
    widest = max(counts)
    top_values, top_ids = (logprobs.topk(widest, dim=-1) if widest
                           else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(token_id, value, tuple(zip(ids[:k], values[:k], strict=True)))
            for token_id, value, ids, values, k in zip(
                token_ids, chosen.tolist(), top_ids, top_values, counts, strict=True)]


# Where top-k / top-p look for their cut-off first: a trained model's nucleus at usual settings
# is a few to a few dozen tokens. A row whose kept set fills the head is looked at again with a
# wider one; past that, a top-p row finds its cut-off by bucketing (nucleus_cutoffs) and a row
# with a top-k beyond the head sorts its whole vocabulary.
FIRST_HEAD = 64
WIDER_HEAD = 1024
# Probabilities are bucketed by their float32 bit pattern shifted right this far: sign,
# exponent and the top 7 mantissa bits, so a bucket spans under 1 % of its values and buckets
# are ordered as the values are (non-negative floats order as their bit patterns do).
BUCKET_SHIFT = 16
NUM_BUCKETS = (0x3F800000 >> BUCKET_SHIFT) + 1  # through 1.0's bits


def device_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token, or INVALID_TOKEN for a row whose pick is not finite, computed
    where the logits are (a GPU): only the ids come back."""
    chosen = logits.argmax(dim=1)
    usable = logits.gather(1, chosen.unsqueeze(1)).squeeze(1).isfinite()
    return chosen.masked_fill(~usable, INVALID_TOKEN).tolist()


class Sampler:
    """Picks one token per row of logits; each row has its own params and generator.

    A sampled row costs a few passes over its logits, batched with the other rows: temperature,
    then softmax for a row without top-k / top-p, or logsumexp and the `head` most likely
    tokens for one with them; then a single uniform draw from the row's generator against the
    cumulative distribution of what it keeps, in token id order (torch.multinomial per row
    and a full sort for top-p cost tens to hundreds of ms a step). A row's token depends only
    on its logits, params and generator, not on its batch: the cut-off is a probability, with
    ties kept, found from float64 running sums on every path, and the draw runs in token id
    order, whatever width the batch gave the head.

    A row whose maximum logit is not finite gets INVALID_TOKEN; the other rows are unaffected.
    Logits on a GPU are sampled there, within the device mode of ModelRunner.sampling_device
    (the tensors made from params go to the logits' device); only the ids come back.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[int]:
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) == len(params):
            token_ids = [0] * len(params)
        elif logits.device.type == "cpu":
            # numpy's argmax (SIMD, same first-maximum tie rule) is ~10x faster than torch's on
            # CPU for a step's [rows, vocabulary] logits: 0.16 vs 1.6 ms at 64 rows of 30,522.
            # It picks a row's first NaN if it has one, so the picked logit tells whether the
            # row was usable without another pass over it.
            array = logits.numpy()
            chosen = array.argmax(axis=1)
            usable = np.isfinite(array[np.arange(len(array)), chosen])
            token_ids = [t if ok else INVALID_TOKEN
                         for t, ok in zip(chosen.tolist(), usable.tolist(), strict=True)]
        else:
            token_ids = device_argmax(logits)
        if not random_rows:
            return token_ids
        if len(random_rows) < len(params):
            logits = logits[torch.tensor(random_rows)]
        usable = torch.isfinite(logits.amax(dim=-1)).tolist()  # amax propagates NaN
        if not all(usable):
            for i, ok in zip(random_rows, usable, strict=True):
                if not ok:
                    token_ids[i] = INVALID_TOKEN
            logits = logits[torch.tensor(usable)]
            random_rows = [i for i, ok in zip(random_rows, usable, strict=True) if ok]
            if not random_rows:
                return token_ids
        # Each row's generator lives on the CPU, so a seed gives the same draws on any device.
        uniforms = torch.cat([torch.rand(1, generator=generators[i], device="cpu")
                              for i in random_rows]).to(logits.device)
        for rows, probs, ids in self.candidates(logits, [params[i] for i in random_rows]):
            chosen = draw(probs, uniforms[rows])
            if ids is not None:
                chosen = ids.gather(1, chosen.unsqueeze(1)).squeeze(1)
            for row, token_id in zip(rows.tolist(), chosen.tolist(), strict=True):
                token_ids[random_rows[row]] = token_id
        return token_ids

    @classmethod
    def probabilities(cls, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits after top-k and top-p filtering, per row."""
        result = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for rows, probs, ids in cls.candidates(logits, params):
            if ids is None:
                result[rows] = probs
            else:
                result[rows] = result[rows].scatter(1, ids, probs)
        return result / result.sum(dim=-1, keepdim=True)

    @staticmethod
    def candidates(
        logits: torch.Tensor, params: list[SamplingParams]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Groups of (rows, probabilities, token ids): what each row may draw, in token id
        order, with probability zero where top-k or top-p drop a token (not renormalised).
        Token ids None: the whole vocabulary, in order."""
        vocab = logits.shape[-1]
        logits = logits.float()
        is_filtered = [0 < p.top_k < vocab or p.top_p < 1 for p in params]
        for wanted in (False, True):
            indices = [i for i, f in enumerate(is_filtered) if f == wanted]
            if not indices:
                continue
            rows = torch.tensor(indices)
            group = logits if len(indices) == len(params) else logits[rows]
            temperatures = torch.tensor([[params[i].temperature] for i in indices])
            if not wanted:
                yield rows, (group / temperatures).softmax(dim=-1), None
                continue
            top_ks = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab
                                   for i in indices])
            top_ps = torch.tensor([params[i].top_p for i in indices])
            for subset, probs, ids in top_k_top_p(group, temperatures, top_ks, top_ps):
                yield rows[subset], probs, ids


def top_k_top_p(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Groups of (rows, probabilities, token ids) as in Sampler.candidates, for rows with
    top-k and/or top-p; `top_ks` holds the vocabulary size where top-k is off.

    vLLM's order: top-p applies to the top-k set renormalised, and the most likely token always
    stays. Tokens tied with the cut-off stay too, so the kept set never depends on how topk
    ordered equal values. Only rows with top-p and no top-k need their softmax's normaliser
    (a pass over the vocabulary); the others are scaled to their most likely token."""
    vocab = logits.shape[-1]
    top_p_only = top_ks >= vocab
    log_norm = torch.zeros(len(logits), 1)
    if bool(top_p_only.any()):
        log_norm[top_p_only] = (logits[top_p_only] / temperatures[top_p_only]).logsumexp(
            dim=-1, keepdim=True)
    finite_ks = top_ks[top_ks < vocab]
    # One past the largest k, so that a token tied with a row's k-th shows up in the head.
    head = max(FIRST_HEAD, int(finite_ks.max()) + 1 if len(finite_ks) else 0)
    pending = torch.arange(len(logits))
    while len(pending):
        head = min(head, vocab)
        if head == vocab and bool(top_p_only[pending].any()):
            rows = pending[top_p_only[pending]]
            probs = (logits[rows] / temperatures[rows] - log_norm[rows]).exp()
            cutoffs = nucleus_cutoffs(probs, top_ps[rows])
            yield rows, probs.masked_fill_(probs < cutoffs, 0.0), None
            pending = pending[~top_p_only[pending]]
            continue
        # Descending (temperature keeps the order); for the whole vocabulary a sort, which is
        # faster than topk there.
        top = (logits[pending].sort(dim=-1, descending=True) if head == vocab
               else logits[pending].topk(head, dim=-1))
        scaled = top.values / temperatures[pending]
        shift = torch.where(top_p_only[pending].unsqueeze(1), log_norm[pending], scaled[:, :1])
        probs = (scaled - shift).exp()
        ks, ps = top_ks[pending], top_ps[pending]
        in_top_k = torch.arange(head) < ks.unsqueeze(1)
        top_k_probs = (probs * in_top_k).double()
        # Running sums, not .sum(): a row's prefix comes out the same at any head width. In
        # float64, as nucleus_cutoffs sums, so a row decides alike on either path.
        cumulative = top_k_probs.cumsum(dim=-1)
        mass = torch.where(ks < vocab, cumulative[:, -1], torch.ones_like(cumulative[:, -1]))
        # (Rows without top-p skip the mass test: 1 - a tiny probability rounds to 1.)
        within_p = ((cumulative - top_k_probs < (ps.double() * mass).unsqueeze(1))
                    | (ps >= 1).unsqueeze(1))
        nucleus = in_top_k & within_p
        cutoff = probs.gather(1, nucleus.sum(dim=-1, keepdim=True) - 1)
        keep = probs >= cutoff
        # A kept set that reaches the head's end may go on past it.
        resolved = ~keep[:, -1] | (head == vocab)
        if bool(resolved.any()):
            ids, kept_probs = top.indices[resolved], (probs * keep)[resolved]
            if head == vocab:  # back to token id order by scattering, not by a second sort
                yield pending[resolved], torch.zeros_like(kept_probs).scatter_(
                    1, ids, kept_probs), None
            else:
                order = ids.argsort(dim=-1)
                yield pending[resolved], kept_probs.gather(1, order), ids.gather(1, order)
        pending = pending[~resolved]
        head = WIDER_HEAD if head < WIDER_HEAD else vocab


def nucleus_cutoffs(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` (a softmax), the smallest probability top-p keeps, without sorting
    the vocabulary: for a flat distribution a full sort cost 8 ms a row of 152k tokens here.

    Each row's probabilities are summed per bucket (BUCKET_SHIFT); the masses above each
    bucket tell which bucket the nucleus ends in, and only that bucket's members are sorted.
    Masses are summed in float64, as a sorted cumulative sum would be."""
    rows = len(probs)
    buckets = (probs.view(torch.int32) >> BUCKET_SHIFT).long()
    offsets = (torch.arange(rows) * NUM_BUCKETS).unsqueeze(1)
    mass = torch.zeros(rows * NUM_BUCKETS, dtype=torch.float64).index_add_(
        0, (buckets + offsets).flatten(), probs.flatten().double()).view(rows, NUM_BUCKETS)
    above = mass.flip(-1).cumsum(-1).flip(-1) - mass  # mass of the higher buckets
    # The nucleus ends in the lowest bucket with less than top_p above it (never empty: the
    # bucket below it has top_p or more above, this bucket's mass included).
    boundary = (above >= top_ps.double().unsqueeze(1)).sum(dim=-1)
    cutoffs = torch.empty(rows, 1, dtype=probs.dtype)
    for row in range(rows):
        bucket = int(boundary[row])
        members = probs[row][buckets[row] == bucket].sort(descending=True).values
        before = above[row, bucket] + members.double().cumsum(0) - members.double()
        kept = int((before < float(top_ps[row])).sum())
        cutoffs[row] = members[max(kept, 1) - 1]
    return cutoffs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the position whose cumulative probability first passes uniform * total."""
    cumulative = probs.cumsum(dim=-1)  # torch accumulates float32 in float64 on CPU
    total = cumulative[:, -1:]
    # Strictly below the total, so the first entry passing it adds a kept token's mass.
    points = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros(())))
    return torch.searchsorted(cumulative, points, right=True).squeeze(1)
