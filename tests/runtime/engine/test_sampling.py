"""Sampler and SamplingParams: greedy, temperature, top-k, top-p, per-sequence seeds."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.engine.sampling import Sampler, SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    params = [SamplingParams(temperature=0.0)] * 2
    assert Sampler()(logits, params, [gen(0), gen(1)]) == [1, 0]


def test_greedy_ties_go_to_the_lowest_token_id_as_in_torch():
    logits = torch.full((3, 30522), -1.0)
    logits[0, [7, 3, 30000]] = 2.0
    logits[1, 30521] = 0.5
    logits[2, [0, 1]] = 4.0
    greedy = SamplingParams(temperature=0)
    tokens = Sampler()(logits, [greedy] * 3, [torch.Generator()] * 3)
    assert tokens == [3, 30521, 0] == logits.argmax(dim=-1).tolist()


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = Sampler.probabilities(logits, [SamplingParams(temperature=2.0)])
    assert torch.allclose(probs, torch.softmax(logits / 2.0, dim=-1))


def test_top_k_keeps_only_the_k_most_likely():
    probs = Sampler.probabilities(logits_of(PROBS), [SamplingParams(top_k=2)])
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    off = Sampler.probabilities(logits_of(PROBS), [SamplingParams(top_k=-1)])
    assert torch.allclose(off, torch.tensor([PROBS]))


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = Sampler.probabilities(logits_of(PROBS), [SamplingParams(top_p=0.7)])
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    # The most likely token always survives, however small p is.
    tiny = Sampler.probabilities(logits_of(PROBS), [SamplingParams(top_p=0.01)])
    assert torch.allclose(tiny, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_rows_get_their_own_filters():
    logits = torch.cat([logits_of(PROBS), logits_of(PROBS)])
    probs = Sampler.probabilities(logits, [SamplingParams(top_k=1), SamplingParams()])
    assert torch.allclose(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(probs[1], torch.tensor(PROBS))


def test_samples_follow_the_distribution_and_stay_in_the_support():
    sampler = Sampler()
    generator = gen(0)
    params = [SamplingParams(top_k=3)]
    draws = [sampler(logits_of(PROBS), params, [generator])[0] for _ in range(2000)]
    assert set(draws) <= {0, 1, 2}
    assert abs(draws.count(0) / 2000 - 0.5 / 0.95) < 0.05


def test_same_seed_same_tokens_and_greedy_rows_ignore_randomness():
    sampler = Sampler()
    logits = torch.randn(3, 50, generator=gen(1))
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]

    def draw(seed):
        gens = [gen(seed), gen(seed + 1), gen(seed + 2)]
        return [sampler(logits, params, gens) for _ in range(20)]

    first, again, other = draw(10), draw(10), draw(99)
    assert first == again
    assert first != other
    assert {row[1] for row in first + other} == {int(logits[1].argmax())}


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"n": 0},
    ],
)
def test_invalid_params_are_rejected_with_the_field_name(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_stop_accepts_a_single_string_and_drops_empty_ones():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["", "x"]).stop == ["x"]
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
