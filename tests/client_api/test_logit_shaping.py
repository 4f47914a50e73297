"""logit_bias, allowed_token_ids and bad_words on a real server with the default model."""

from __future__ import annotations

import pytest
from batchwire.v1 import generate_pb2

from scheduler_svc.core.bad_words import bad_words_token_ids
from tests.client_api.server_process import collect, greedy, text_request

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _ids(server, sampling: generate_pb2.SamplingParams, prompt: str = PROMPT) -> list[int]:
    ids, _, _, _ = collect(server.stub.Generate(text_request(prompt, sampling), timeout=120))
    return ids


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bias_of_100_makes_greedy_output_that_token(server):
    token = 7000
    assert token not in _ids(server, greedy(6))
    assert _ids(server, greedy(6, logit_bias={token: 100.0})) == [token] * 6


def test_allowed_token_ids_keep_every_sampled_token_in_the_set(server, default_tokenizer):
    allowed = default_tokenizer(" one two three four five", add_special_tokens=False).input_ids
    free = _ids(server, greedy(8))
    assert set(free) - set(allowed), "the unrestricted output must leave the set"
    assert set(_ids(server, greedy(8, allowed_token_ids=allowed))) <= set(allowed)
    sampled = generate_pb2.SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                          ignore_eos=True, allowed_token_ids=allowed)
    assert set(_ids(server, sampled)) <= set(allowed)


def test_a_banned_word_never_appears_while_without_the_ban_it_does(server, default_tokenizer):
    sequences = bad_words_token_ids(default_tokenizer, ["Paris"])
    free = _ids(server, greedy(12))
    assert any(_contains(free, s) for s in sequences), default_tokenizer.decode(free)
    banned = _ids(server, greedy(12, bad_words=["Paris"]))
    assert not any(_contains(banned, s) for s in sequences), default_tokenizer.decode(banned)
    assert banned[:len(free)] != free
