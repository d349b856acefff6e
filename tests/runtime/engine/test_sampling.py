"""Sampler and SamplingParams: greedy, temperature, top-k, top-p, per-sequence seeds;
penalties and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.engine.sampling import (
    INVALID_TOKEN,
    WIDER_HEAD,
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    ban_tokens,
    device_argmax,
    token_logprobs,
)

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


def test_rows_without_a_usable_maximum_get_invalid_token_and_spare_the_others():
    vocab = 2000
    clean = torch.randn(vocab, generator=gen(3))
    clean[[5, 17]] = -math.inf  # masked tokens are fine
    nan, posinf, all_masked = clean.clone(), clean.clone(), torch.full((vocab,), -math.inf)
    nan[1234] = math.nan
    posinf[42] = math.inf
    greedy = SamplingParams(temperature=0.0)
    plain, top_k = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=5)
    top_p = SamplingParams(temperature=0.8, top_p=0.9)
    rows = [(clean, greedy), (nan, greedy), (posinf, greedy), (all_masked, greedy),
            (nan, plain), (posinf, top_k), (nan, top_p), (all_masked, top_p),
            (clean, plain), (clean, top_k), (clean, top_p)]
    logits = torch.stack([row for row, _ in rows])
    params = [p for _, p in rows]
    tokens = Sampler()(logits, params, [gen(i) for i in range(len(rows))])
    assert tokens[1:8] == [INVALID_TOKEN] * 7
    alone = [Sampler()(clean.unsqueeze(0), [p], [gen(i)])[0]
             for i, p in enumerate(params) if i in (0, 8, 9, 10)]
    assert [tokens[i] for i in (0, 8, 9, 10)] == alone
    assert INVALID_TOKEN not in alone
    assert Sampler()(nan.unsqueeze(0), [plain], [gen(0)]) == [INVALID_TOKEN]
    # The GPU's greedy pick (torch's argmax where the logits are) agrees with the CPU's (numpy's),
    # first maximum and unusable rows alike.
    ties = torch.zeros(vocab)
    ties[[7, 9]] = 1.0
    greedy_rows = torch.stack([clean, nan, posinf, all_masked, ties])
    assert device_argmax(greedy_rows) == Sampler()(greedy_rows, [greedy] * 5, [gen(0)] * 5) == [
        int(clean.argmax()), INVALID_TOKEN, INVALID_TOKEN, INVALID_TOKEN, 7]


def reference_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The textbook filter, a full sort per row: top-k, then top-p on the renormalised top-k."""
    rows = []
    for row, p in zip(logits, params, strict=True):
        probs = (row / p.temperature).softmax(-1)
        if 0 < p.top_k < len(row):
            probs = torch.where(probs >= probs.topk(p.top_k).values[-1], probs, 0.0)
            probs = probs / probs.sum()
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        rows.append(probs / probs.sum())
    return torch.stack(rows)


@pytest.mark.parametrize("spread", [8.0, 3.0, 0.5], ids=["peaked", "hundreds", "flat"])
def test_filters_match_a_full_sort_whether_the_nucleus_fits_the_first_head_or_not(spread):
    # The spreads put the top-p nucleus inside FIRST_HEAD, between it and WIDER_HEAD, and past
    # WIDER_HEAD (a full sort), so every widening step is compared with the reference.
    logits = torch.randn(6, 30522, generator=gen(3)) * spread
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.3, top_k=2000, top_p=0.95),  # k beyond WIDER_HEAD
        SamplingParams(temperature=0.9, top_k=100, top_p=0.8),
        SamplingParams(temperature=1.0),
    ]
    got = Sampler.probabilities(logits, params)
    want = reference_probabilities(logits, params)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)
    if spread == 0.5:
        assert int((got[0] > 0).sum()) > WIDER_HEAD


def test_tokens_tied_with_the_cutoff_are_all_kept():
    logits = logits_of([0.4, 0.2, 0.2, 0.2])
    probs = Sampler.probabilities(logits, [SamplingParams(top_k=2)])
    assert torch.allclose(probs, torch.tensor([[0.4, 0.2, 0.2, 0.2]]))


def test_draws_land_on_token_ids_not_positions_in_the_head():
    logits = torch.zeros(2, 5000)
    logits[:, 4321] = 12.0
    logits[:, 17] = 11.0
    params = [SamplingParams(top_p=0.5), SamplingParams(top_k=2)]
    draws = [Sampler()(logits, params, [gen(s), gen(s + 1)]) for s in range(200)]
    assert {row[0] for row in draws} == {4321}
    assert {row[1] for row in draws} == {4321, 17}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=30, top_p=0.95),
], ids=["temperature", "top_p", "top_k_top_p"])
def test_draw_frequencies_follow_the_filtered_distribution(params):
    logits = torch.randn(1, 200, generator=gen(5)) * 2
    expected = Sampler.probabilities(logits, [params])[0]
    generator = gen(6)  # one generator for all rows: 4,000 draws in one batched call
    draws = torch.tensor(Sampler()(logits.expand(4000, -1), [params] * 4000, [generator] * 4000))
    seen = torch.bincount(draws, minlength=200) / 4000
    assert float((seen - expected).abs().sum()) / 2 < 0.08  # total variation distance
    assert bool((expected[draws] > 0).all())


def test_a_rows_draw_does_not_depend_on_the_rest_of_its_batch():
    # Other rows change the head's width (a large top-k), the number of widening rounds (a
    # flat row) and which rows are gathered; the first row's tokens must not change.
    logits = torch.cat([
        torch.randn(1, 30522, generator=gen(7)) * 3,
        torch.randn(1, 30522, generator=gen(8)) * 0.5,
        torch.randn(1, 30522, generator=gen(9)) * 3,
    ])
    mine = SamplingParams(temperature=0.9, top_p=0.9)
    others = [SamplingParams(temperature=1.0, top_p=0.99), SamplingParams(temperature=0)]
    for seed in range(30):
        alone = Sampler()(logits[:1], [mine], [gen(seed)])[0]
        batched = Sampler()(logits, [mine, *others], [gen(seed), gen(1), gen(2)])[0]
        wide = SamplingParams(temperature=1.0, top_k=3000)
        widened = Sampler()(logits, [mine, wide, wide], [gen(seed), gen(1), gen(2)])[0]
        assert alone == batched == widened


def test_a_wide_nucleus_decides_alike_by_buckets_alone_or_by_topk_in_a_wide_batch():
    # ~2,000 likely tokens: alone the row passes WIDER_HEAD and takes nucleus_cutoffs; beside
    # a top-k of 3,000 the first head already holds its nucleus.
    logits = torch.randn(2, 30522, generator=gen(11)) * 0.1 - 5
    logits[0, :2000] += 10
    mine = SamplingParams(temperature=1.0, top_p=0.9)
    wide = SamplingParams(temperature=1.0, top_k=3000)
    kept = int((Sampler.probabilities(logits[:1], [mine]) > 0).sum())
    assert WIDER_HEAD < kept < 3000
    assert torch.equal(Sampler.probabilities(logits[:1], [mine])[0],
                       Sampler.probabilities(logits, [mine, wide])[0])
    for seed in range(30):
        alone = Sampler()(logits[:1], [mine], [gen(seed)])[0]
        beside = Sampler()(logits, [mine, wide], [gen(seed), gen(1)])[0]
        assert alone == beside


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"n": 0},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.01},
        {"logprobs": -1},
        {"logprobs": 21},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"min_tokens": 17},  # more than max_tokens (16)
        {"min_tokens": -1},
        {"logit_bias": {5: 100.5}},
        {"logit_bias": {-1: 1.0}},
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


def test_penalties_follow_vllms_arithmetic_and_leave_other_rows_alone():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 0.0],
                           [2.0, -2.0, 1.0, 0.5, -1.0, 0.0]])
    prompt, output = [0, 1], [2, 2, 3]  # token 0 and 1 only in the prompt
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [1], [params], [torch.tensor(prompt)], [output])
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 0.5, -1.0, 0.0]
    # Repetition over prompt and output: positive logits halved, negative doubled. Frequency
    # (0.5 a use) and presence (0.25 once) over the output only.
    assert logits[1].tolist() == pytest.approx(
        [1.0, -4.0, 0.5 - 2 * 0.5 - 0.25, 0.25 - 0.5 - 0.25, -1.0, 0.0])


def test_negative_additive_penalties_favour_what_was_said():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5)
    apply_penalties(logits, [0], [params], [torch.tensor([3])], [[1, 1, 2]])
    assert logits[0].tolist() == [0.0, 2.5, 1.5, 0.0]


def test_penalties_change_greedy_picks():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, presence_penalty=0.2)
    apply_penalties(logits, [0], [params], [torch.tensor([2])], [[0]])
    assert Sampler()(logits, [params], [gen(0)]) == [1]
    assert SamplingParams(presence_penalty=0.2).has_penalties
    assert not SamplingParams().has_penalties


def test_token_logprobs_are_the_chosen_token_and_the_k_most_likely():
    logits = torch.tensor([[2.0, 1.0, -0.5, 1.6], [-2.0, 3.0, 0.0, 1.0]])
    logprobs = logits.log_softmax(dim=-1).tolist()
    first, second = token_logprobs(logits.log_softmax(dim=-1), [2, 1], [2, 0])
    assert (first.token_id, first.logprob) == (2, pytest.approx(logprobs[0][2]))
    assert [i for i, _ in first.top] == [0, 3]
    assert [lp for _, lp in first.top] == pytest.approx([logprobs[0][0], logprobs[0][3]])
    assert (second.token_id, second.logprob, second.top) == (
        1, pytest.approx(logprobs[1][1]), ())


def test_penalties_of_several_rows_at_once_equal_one_row_at_a_time():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    prompts = [[1, 2, 2, 3], [4], [5, 6, 7, 1], [0, 49]]
    outputs = [[3, 3, 8, 9, 3], [4, 4], [], [49, 10, 10]]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7),
              SamplingParams(presence_penalty=1.0),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5),
              SamplingParams(repetition_penalty=1.5, frequency_penalty=-1.0,
                             presence_penalty=2.0)]
    rows = [0, 2, 3]  # row 1 brings no penalties this step
    expected = logits.clone()
    for row in rows:
        for token in set(prompts[row] + outputs[row]):
            if params[row].repetition_penalty != 1.0:
                value = expected[row, token]
                penalty = params[row].repetition_penalty
                expected[row, token] = value * penalty if value < 0 else value / penalty
        for token in set(outputs[row]):
            expected[row, token] = (expected[row, token]
                                    - params[row].frequency_penalty * outputs[row].count(token)
                                    - params[row].presence_penalty)
    apply_penalties(logits, rows, [params[r] for r in rows],
                    [torch.tensor(prompts[r]).unique() for r in rows], [outputs[r] for r in rows])
    assert torch.equal(logits, expected)


def test_logit_bias_adds_to_its_rows_tokens_and_banned_tokens_cannot_be_picked():
    logits = torch.zeros(3, 5)
    apply_logit_bias(logits, [0, 2], [{1: 2.5, 4: -100.0}, {0: 1.0}])
    assert logits.tolist() == [[0, 2.5, 0, 0, -100.0], [0] * 5, [1.0, 0, 0, 0, 0]]
    ban_tokens(logits, [0, 1], [[1], [0, 3]])
    assert logits[0, 1] == logits[1, 0] == logits[1, 3] == -math.inf
    picks = Sampler()(logits, [SamplingParams(temperature=0)] * 3, [gen(0)] * 3)
    assert picks == [0, 1, 0]


def test_min_p_keeps_tokens_at_least_that_likely_relative_to_the_top_at_its_temperature():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log().repeat(3, 1)
    params = [SamplingParams(min_p=0.2), SamplingParams(min_p=0.2, temperature=2.0)]
    apply_min_p(logits, [0, 2], params)
    assert torch.isinf(logits[0]).tolist() == [False, False, False, True]  # 0.08 < 0.2 * 0.5
    assert not torch.isinf(logits[1]).any()  # not asked
    # At temperature 2 the distribution is flatter: 0.08 ** 0.5 / 0.5 ** 0.5 = 0.4 >= 0.2.
    assert not torch.isinf(logits[2]).any()


def test_draws_after_min_p_follow_its_renormalised_distribution():
    logits = torch.randn(1, 200, generator=gen(5)) * 2
    params = SamplingParams(temperature=0.9, min_p=0.1)
    probs = (logits[0] / 0.9).softmax(dim=-1)
    expected = torch.where(probs >= 0.1 * probs.max(), probs, 0.0)
    expected /= expected.sum()
    rows = logits.expand(4000, -1).clone()
    apply_min_p(rows, list(range(4000)), [params] * 4000)
    draws = torch.tensor(Sampler()(rows, [params] * 4000, [gen(6)] * 4000))
    seen = torch.bincount(draws, minlength=200) / 4000
    assert float((seen - expected).abs().sum()) / 2 < 0.08  # total variation distance
    assert bool((expected[draws] > 0).all())
