"""Sampler tests against hand-computed distributions, masks and penalty arithmetic."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from batchwire.v1 import worker_pb2

from worker_svc.sample import sampler as sampler_module
from worker_svc.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    row_argmax,
)
from worker_svc.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata


def params(**fields) -> worker_pb2.RequestSamplingParams:
    """A real protobuf message; temperature 1 and every filter off unless given."""
    fields = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, **fields}
    return worker_pb2.RequestSamplingParams(**fields)


def metadata(
    ps: list[worker_pb2.RequestSamplingParams],
    vocab: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    return build_sampling_metadata(
        ps,
        outputs if outputs is not None else [[] for _ in ps],
        prompts if prompts is not None else [[] for _ in ps],
        generators or {},
        vocab,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def hand_softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(x / temperature) for x in logits]
    return [e / sum(exps) for e in exps]


def chi_square(draws: torch.Tensor, expected: list[float]) -> float:
    """Pearson's statistic; tokens with expected probability 0 must never be drawn."""
    counts = torch.bincount(draws, minlength=len(expected)).tolist()
    n = draws.numel()
    stat = 0.0
    for count, p in zip(counts, expected, strict=True):
        if p == 0.0:
            assert count == 0, f"drew a masked token {count} times"
        else:
            stat += (count - n * p) ** 2 / (n * p)
    return stat


# Upper 0.1% points of chi-square with 1, 2 and 3 degrees of freedom: seeds are fixed, so a
# pass is deterministic, and a wrong distribution at n = 20000 lands far beyond these.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27}


def finite(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_greedy_takes_argmax_whatever_the_filters():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    ps = [
        params(temperature=0.0),
        params(temperature=0.0, top_k=2),
        params(temperature=0.0, top_p=0.1),
    ]
    md = metadata(ps, vocab=4)
    assert md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [1, 0, 3]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_greedy_rows_stay_greedy_beside_random_rows():
    # Row 1 is nearly uniform, so random draws differ from its argmax most of the time.
    logits = torch.tensor([[0.0, 1.0, 0.2], [0.1, 0.0, 0.0]]).repeat(500, 1)  # [1000, 3]
    md = metadata([params(temperature=0.0), params(temperature=1.0)] * 500, vocab=3)
    sampled = Sampler(seeded(0))(logits, md).sampled_token_ids.view(500, 2)
    assert (sampled[:, 0] == 1).all()
    assert set(sampled[:, 1].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_unseeded_draws_follow_softmax_over_temperature(temperature: float):
    row = [1.0, 0.0, -0.5, 2.0]
    n = 20000
    logits = torch.tensor([row]).repeat(n, 1)  # [n, 4]: one draw per row
    md = metadata([params(temperature=temperature)] * n, vocab=4)
    draws = Sampler(seeded(0))(logits, md).sampled_token_ids
    assert chi_square(draws, hand_softmax(row, temperature)) < CHI2_999[3]


def test_seeded_rows_follow_softmax_too():
    row = [0.5, -1.0, 1.5, 0.0]
    n = 4000
    logits = torch.tensor([row]).repeat(n, 1)  # [n, 4]
    md = metadata([params(temperature=0.8)] * n, 4, generators={i: seeded(i) for i in range(n)})
    draws = Sampler()(logits, md).sampled_token_ids
    assert chi_square(draws, hand_softmax(row, 0.8)) < CHI2_999[3]


@pytest.mark.parametrize("with_top_p", [False, True], ids=["top-k alone", "with top-p"])
def test_top_k_keeps_the_k_largest_and_their_ties(with_top_p: bool):
    logits = torch.tensor(
        [
            [1.0, 4.0, 3.0, 2.0, 0.0],  # k = 2
            [1.0, 4.0, 3.0, 2.0, 0.0],  # k = 0: off
            [1.0, 4.0, 3.0, 2.0, 0.0],  # k = vocab: off
            [1.0, 3.0, 3.0, 0.0, 2.0],  # k = 1 with a tie at the top: both stay
        ]
    )
    top_k = torch.tensor([2, 0, 5, 1])
    top_p = torch.ones(4) if with_top_p else None
    apply_top_k_top_p(logits, top_k, top_p)
    assert [finite(r) for r in logits] == [{1, 2}, set(range(5)), set(range(5)), {1, 2}]
    assert logits[0, 1] == 4.0 and logits[0, 2] == 3.0  # kept logits are untouched


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.1, 0.4, 0.2, 0.3]
    logits = torch.tensor([probs]).log().repeat(5, 1)  # [5, 4]
    # Sorted: 0.4, 0.3, 0.2, 0.1; mass before each: 0, 0.4, 0.7, 0.9.
    top_p = torch.tensor([0.3, 0.6, 0.75, 0.95, 1.0])
    apply_top_k_top_p(logits, None, top_p)
    assert [finite(r) for r in logits] == [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_applies_to_the_distribution_left_by_top_k():
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log().repeat(2, 1)  # [2, 4]
    # Without top-k, 0.4 < 0.5 lets token 3 in; after top-k = 2 token 1 holds 0.4 / 0.7 > 0.5.
    apply_top_k_top_p(logits, torch.tensor([0, 2]), torch.tensor([0.5, 0.5]))
    assert [finite(r) for r in logits] == [{1, 3}, {1}]


def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    """Plain Python, float64: sort, cut to k, keep tokens while the mass before them is < p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if 0 < k < len(row):
        order = order[:k]
    if p >= 1.0:
        return set(order)
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    kept, mass = set(), 0.0
    for token, weight in zip(order, weights, strict=True):
        if mass >= p:
            break
        kept.add(token)
        mass += weight / sum(weights)
    return kept


def test_top_p_widens_its_candidates_for_flat_rows(monkeypatch: pytest.MonkeyPatch):
    # Eight candidates first, so flat rows retry at 128, 2048 and then the whole vocabulary.
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 8)
    vocab = 3000
    cases = [(k, p) for k in (0, 50, 2000) for p in (0.5, 0.9, 1.0)]
    scales = torch.tensor([0.3, 3.0]).repeat_interleave(len(cases)).unsqueeze(1)  # [2 * cases, 1]
    logits = torch.randn(2 * len(cases), vocab, generator=seeded(5)) * scales
    rows = logits.tolist()
    top_k = torch.tensor([k for k, _ in cases] * 2)
    top_p = torch.tensor([p for _, p in cases] * 2)
    apply_top_k_top_p(logits, top_k, top_p)
    for i, row in enumerate(rows):
        assert finite(logits[i]) == reference_top_k_top_p(row, int(top_k[i]), float(top_p[i]))


def test_min_p_masks_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)  # [3, 4]
    apply_min_p(logits, torch.tensor([0.2, 0.5, 0.0]))  # thresholds 0.1, 0.25, none
    assert [finite(r) for r in logits] == [{0, 1, 2}, {0, 1}, {0, 1, 2, 3}]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"top_k": 2}, [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]),
        ({"top_p": 0.75}, [0.0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9]),
        # min-p 0.6 of the top 0.4 is 0.24: of top-p's three, 0.2 goes.
        ({"top_p": 0.75, "min_p": 0.6}, [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]),
    ],
)
def test_filtered_draws_follow_the_renormalised_distribution(filters, expected):
    n = 20000
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log().repeat(n, 1)  # [n, 4]
    md = metadata([params(**filters)] * n, vocab=4)
    draws = Sampler(seeded(1))(logits, md).sampled_token_ids
    dof = sum(p > 0 for p in expected) - 1
    assert chi_square(draws, expected) < CHI2_999[dof]


def test_penalties_match_hand_arithmetic():
    row = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    logits = torch.tensor([row] * 6)  # [6, 6]
    ps = [
        params(repetition_penalty=2.0),
        params(frequency_penalty=0.5),
        params(presence_penalty=0.25),
        params(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        params(repetition_penalty=2.0),  # nothing seen yet: nothing to penalise
        params(repetition_penalty=2.0, frequency_penalty=0.5),  # repeats penalised once
    ]
    outputs = [[3, 3, 4]] * 4 + [[], [3]]
    prompts = [[0, 1]] * 4 + [[], [3, 3, 0]]
    md = metadata(ps, vocab=6, outputs=outputs, prompts=prompts)
    assert md.prompt_token_ids is not None and md.prompt_token_ids[4].tolist() == [6, 6, 6]
    apply_penalties(logits, md)
    # Seen: 0, 1 (prompt), 3 twice and 4 once (output). Repetition divides positive logits and
    # multiplies negative ones; frequency subtracts 0.5 per output count; presence 0.25 once.
    assert logits.tolist() == [
        [1.0, -2.0, 0.5, 1.5, -4.0, 1.0],
        [2.0, -1.0, 0.5, 2.0, -2.5, 1.0],
        [2.0, -1.0, 0.5, 2.75, -2.25, 1.0],
        [1.0, -2.0, 0.5, 0.25, -4.75, 1.0],
        row,
        [1.0, -1.0, 0.5, 1.0, -2.0, 1.0],
    ]


def test_penalties_change_what_greedy_picks():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.8]] * 2)  # [2, 6]
    ps = [params(temperature=0.0), params(temperature=0.0, frequency_penalty=1.5)]
    md = metadata(ps, vocab=6, outputs=[[3], [3]], prompts=[[0], [0]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [3, 0]


def test_min_tokens_holds_back_stop_ids_then_releases_them():
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0, 4.5])  # [5]: EOS = 2 is the favourite, then 4
    ps = [params(temperature=0.0, min_tokens=3, stop_token_ids=[2, 4])]
    outputs: list[list[int]] = [[]]
    md = metadata(ps, vocab=5, outputs=outputs)
    sampler = Sampler()
    for _ in range(4):  # the same metadata across steps: the output list grows in place
        outputs[0].append(int(sampler(logits.clone().unsqueeze(0), md).sampled_token_ids[0]))
    assert outputs[0] == [3, 3, 3, 2]


def test_min_tokens_masks_random_rows_too():
    n = 2000
    logits = torch.tensor([[0.0, 3.0, 0.0]]).repeat(n, 1)  # [n, 3]
    md = metadata([params(min_tokens=1, stop_token_ids=[1])] * n, vocab=3)
    draws = Sampler(seeded(0))(logits, md).sampled_token_ids
    assert chi_square(draws, [0.5, 0.0, 0.5]) < CHI2_999[1]


def hand_log_softmax(row: list[float]) -> list[float]:
    lse = math.log(sum(math.exp(x) for x in row))
    return [x - lse for x in row]


def test_logprobs_are_of_raw_logits_with_top_n_and_rank():
    rows = [[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 2.5, 1.0], [0.0, 1.0, 3.0, 2.0]]
    ps = [
        # The penalty turns token 1's 3.0 into 0.75, so greedy picks token 2: rank 2.
        params(temperature=0.0, repetition_penalty=4.0, logprobs=2),
        params(temperature=0.0, logprobs=1),
        # top-k 1 makes the draw certain; the logprobs must ignore the temperature.
        params(temperature=0.5, top_k=1, logprobs=0),
    ]
    md = metadata(ps, vocab=4, outputs=[[1], [], []], prompts=[[], [], []])
    out = Sampler()(torch.tensor(rows), md)
    assert out.sampled_token_ids.tolist() == [2, 2, 2]
    assert out.logprobs is not None
    assert out.logprobs.token_ids.tolist() == [[2, 1, 2], [2, 2, 3], [2, 2, 3]]
    lp = [hand_log_softmax(r) for r in rows]
    expected = [
        [lp[0][2], lp[0][1], lp[0][2]],
        [lp[1][2], lp[1][2], lp[1][3]],
        [lp[2][2]] * 2 + [lp[2][3]],
    ]
    assert out.logprobs.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.logprobs, torch.tensor(expected))
    assert out.logprobs.sampled_rank.tolist() == [2, 1, 1]


def test_logprobs_zero_returns_only_the_sampled_token():
    md = metadata([params(temperature=0.0, logprobs=0)], vocab=3)
    out = Sampler()(torch.tensor([[0.0, 1.0, 2.0]]), md)
    assert out.logprobs is not None and out.logprobs.token_ids.tolist() == [[2]]


def seeded_draws(layout: list[str], row_logits: torch.Tensor, steps: int) -> list[int]:
    """Draws of the request "me" (seed 1234) placed among neighbours as the layout says."""
    neighbours = {
        "unseeded": params(temperature=1.3),
        "seeded": params(temperature=0.9),
        "greedy": params(temperature=0.0),
        "top_k": params(top_k=5),
        "top_p": params(top_p=0.8, min_p=0.05),
        "penalised": params(frequency_penalty=0.7, repetition_penalty=1.3),
        "me": params(temperature=0.8),
    }
    ps = [neighbours[name] for name in layout]
    gens = {
        row: seeded(1234 if name == "me" else 99 + row)
        for row, name in enumerate(layout)
        if name in ("me", "seeded")
    }
    outputs: list[list[int]] = [[] for _ in layout]
    md = metadata(
        ps,
        vocab=row_logits.shape[1],
        outputs=outputs,
        prompts=[[1, 2]] * len(layout),
        generators=gens,
    )
    sampler = Sampler(seeded(len(layout)))  # a different shared stream in each layout
    me = layout.index("me")
    noise = seeded(7 * len(layout))
    draws = []
    for step in range(steps):
        logits = torch.randn(len(layout), row_logits.shape[1], generator=noise)  # neighbours
        logits[me] = row_logits[step]
        sampled = sampler(logits, md).sampled_token_ids
        for row, token in enumerate(sampled.tolist()):
            outputs[row].append(token)
        draws.append(outputs[me][-1])
    return draws


def test_seeded_draws_do_not_depend_on_the_batch():
    steps, vocab = 8, 64
    row_logits = torch.randn(steps, vocab, generator=seeded(3)) * 0.5  # [steps, vocab]: flat-ish
    alone = seeded_draws(["me"], row_logits, steps)
    assert len(set(alone)) > 1
    assert seeded_draws(["unseeded", "me", "seeded", "top_k"], row_logits, steps) == alone
    layout = ["greedy", "top_p", "seeded", "penalised", "unseeded", "me"]
    assert seeded_draws(layout, row_logits, steps) == alone


def test_metadata_from_protobuf_messages():
    ps = [
        params(temperature=0.0),
        params(top_p=0.9, logprobs=3),
        params(top_k=5, min_p=0.1),
        worker_pb2.RequestSamplingParams(),  # all proto3 defaults: greedy, filters off
    ]
    md = metadata(ps, vocab=10)
    assert not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert md.top_k is not None and md.top_k.tolist() == [0, 0, 5, 0]
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0])
    assert md.no_penalties and md.prompt_token_ids is None
    assert md.repetition_penalties.tolist() == [1.0] * 4
    assert md.max_num_logprobs == 3 and md.min_tokens == {}


def test_metadata_from_plain_objects():
    plain = dict(
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.1,
        min_tokens=2,
        stop_token_ids=[2],
        logprobs=None,
        logit_bias={},
        allowed_token_ids=[],
        bad_words=[],
    )
    ps = [SimpleNamespace(**plain), SimpleNamespace(**{**plain, "min_tokens": 0, "logprobs": 0})]
    outputs: list[list[int]] = [[5], []]
    md = build_sampling_metadata(ps, outputs, [[4, 5, 6], [7]], {}, vocab_size=8)
    assert md.all_random and md.top_p is None and md.top_k is None and md.min_p is None
    assert not md.no_penalties
    assert md.prompt_token_ids is not None and md.prompt_token_ids.tolist() == [
        [4, 5, 6],
        [7, 8, 8],
    ]
    assert md.output_token_ids is outputs
    assert md.min_tokens == {0: (2, [2])}
    assert md.max_num_logprobs == 0


def test_empty_batch():
    md = metadata([], vocab=4)
    assert Sampler()(torch.empty(0, 4), md).sampled_token_ids.shape == (0,)


def test_row_argmax_is_torch_argmax_ties_nan_and_infinities_included():
    """The numpy reduction the CPU path takes picks what torch's argmax/argmin pick."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (64, 50), generator=gen).float()  # many ties per row
    x[5, 7] = x[6, 0] = x[6, 9] = float("nan")
    x[7] = float("-inf")
    x[8, 3] = float("inf")
    x[9] = -0.0
    x[9, 4] = 0.0
    for t in (x, x.double(), x[:, ::2], x.t().contiguous().t()):  # strided views too
        for smallest in (False, True):
            expected = t.argmin(dim=-1) if smallest else t.argmax(dim=-1)
            got = row_argmax(t, smallest)
            assert got.dtype == torch.int64 and torch.equal(got, expected), (t.stride(), smallest)
