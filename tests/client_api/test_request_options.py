"""Request options that change what is run rather than how tokens are chosen, on a real server."""

from __future__ import annotations

import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import collect, greedy

pytestmark = pytest.mark.slow

R = generate_pb2.GenerateRequest


def test_truncated_prompt_runs_as_the_truncated_prompt_sent(server, default_tokenizer):
    ids = default_tokenizer("Once upon a time, in a land far away, there lived a king who had "
                            "three daughters. The youngest", add_special_tokens=False).input_ids
    k = 12
    cut = collect(server.stub.Generate(R(token_ids=ids, sampling=greedy(
        8, truncate_prompt_tokens=k)), timeout=120))
    sent = collect(server.stub.Generate(R(token_ids=ids[-k:], sampling=greedy(8)), timeout=120))
    whole = collect(server.stub.Generate(R(token_ids=ids, sampling=greedy(8)), timeout=120))
    assert cut[0] == sent[0] and cut[1] == sent[1]
    assert cut[2].usage.prompt_tokens == k and whole[2].usage.prompt_tokens == len(ids)
    assert cut[0] != whole[0], "the cut must matter for this test to show anything"
    # A prompt longer than max_model_len (256) runs once truncated.
    long = collect(server.stub.Generate(R(token_ids=[100] * 300 + ids[-k:], sampling=greedy(
        8, truncate_prompt_tokens=k)), timeout=120))
    assert long[0] == sent[0]
