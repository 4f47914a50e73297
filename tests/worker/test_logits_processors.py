"""Logit shaping in the sampler: bias, allowed set and banned sequences on hand-made logits."""

from __future__ import annotations

import torch
from batchwire.v1 import worker_pb2

from tests.worker.test_sampler import metadata, params, seeded
from worker_svc.sample.logits_processors import build_logit_shaping
from worker_svc.sample.sampler import Sampler

VOCAB = 8


def banned(*sequences: list[int]) -> list[worker_pb2.TokenIds]:
    return [worker_pb2.TokenIds(ids=s) for s in sequences]


def test_no_shaping_builds_nothing():
    assert build_logit_shaping([params(), params()], VOCAB) is None


def test_bias_of_100_wins_greedy_and_is_clamped_at_100():
    logits = torch.tensor([[0.0, 50.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    # +1000 is clamped to +100: token 3 reaches 100 and beats token 1's 50 either way.
    ps = [params(temperature=0, logit_bias={3: 100.0}), params(temperature=0, logit_bias={3: 1e3})]
    md = metadata(ps, VOCAB)
    assert md.shaping is not None and md.shaping.bias_values.tolist() == [100.0, 100.0]
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.tolist() == [3, 3]


def test_negative_bias_removes_the_argmax_only_from_its_row():
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    md = metadata([params(temperature=0, logit_bias={1: -100.0}), params(temperature=0)], VOCAB)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 1]


def test_allowed_set_holds_for_greedy_and_seeded_rows():
    torch.manual_seed(0)
    allowed = [0, 5, 6]
    ps = [params(temperature=0, allowed_token_ids=allowed),
          params(temperature=1.0, allowed_token_ids=allowed, seed=7),
          params(temperature=1.0)]
    seen_free = set()
    for _ in range(200):
        logits = torch.randn(3, VOCAB) * 3
        out = Sampler()(logits, metadata(ps, VOCAB, generators={1: seeded(7)}))
        greedy, drawn, free = out.sampled_token_ids.tolist()
        assert greedy in allowed and drawn in allowed
        seen_free.add(free)
    assert seen_free - set(allowed), "the unrestricted row must still reach other tokens"


def test_allowed_set_keeps_the_best_allowed_token_and_beats_a_bias_outside_it():
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    md = metadata([params(temperature=0, allowed_token_ids=[1, 2], logit_bias={0: 100.0})], VOCAB)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]


def test_one_token_word_is_always_banned():
    logits = torch.tensor([[0.0, 9.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    md = metadata([params(temperature=0, bad_words=banned([1]))], VOCAB, outputs=[[]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]


def test_sequence_ban_masks_its_last_token_only_after_its_prefix():
    ps = [params(temperature=0, bad_words=banned([4, 5, 1]))] * 3
    outputs = [[4, 5], [5, 4], [4]]  # prefix present; reversed; only partly present
    logits = torch.tensor([[0.0, 9.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    out = Sampler()(logits, metadata(ps, VOCAB, outputs=outputs))
    assert out.sampled_token_ids.tolist() == [2, 1, 1]


def test_logprobs_are_of_the_logits_before_shaping():
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    expected = logits.log_softmax(-1)
    md = metadata([params(temperature=0, logprobs=1, logit_bias={3: 100.0})], VOCAB)
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.tolist() == [3]
    assert out.logprobs is not None
    assert out.logprobs.token_ids[0].tolist() == [3, 1]
    torch.testing.assert_close(out.logprobs.logprobs[0], expected[0, [3, 1]])
