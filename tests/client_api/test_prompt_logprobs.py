"""Prompt logprobs on the default model in float32 against transformers' log_softmax, whole and
with the prompt cut into chunks across steps; and through a real server's first message."""

from __future__ import annotations

import pytest
import torch
from batchwire.v1 import generate_pb2

from scheduler_svc import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see"
K = 3
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def reference(hf_default_model, default_tokenizer):
    ids = default_tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        logits = hf_default_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]
    return ids, logits.log_softmax(dim=-1)


def _check(prompt_logprobs, reference) -> None:
    ids, logprobs = reference
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids) - 1
    for p, entry in enumerate(prompt_logprobs):
        target = ids[p + 1]
        assert entry.token_ids[0] == target
        assert abs(entry.logprobs[0] - float(logprobs[p, target])) < TOLERANCE, p
        top = logprobs[p].topk(K)
        assert torch.allclose(torch.tensor(entry.logprobs[1:]), top.values, atol=TOLERANCE), p
        assert entry.sampled_token_rank == int((logprobs[p] > logprobs[p, target]).sum()) + 1


def _run(llm, reference) -> None:
    stats = llm.engine.scheduler.stats
    hits = stats.num_prefix_hits
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    # Twice: the second would hit the first's cached prompt blocks, were it allowed to.
    for out in llm.generate([PROMPT, PROMPT], params, use_tqdm=False):
        _check(out.prompt_logprobs, reference)
    assert stats.num_prefix_hits == hits


def test_prompt_logprobs_equal_transformers(offline_llm, reference):
    _run(offline_llm, reference)


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(reference, default_tokenizer):
    llm = LLM(dtype="float32", tokenizer=default_tokenizer, kv_cache_memory_bytes=16 << 20,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
              long_prefill_token_threshold=5)  # five prompt tokens a step
    try:
        _run(llm, reference)
        assert llm.engine.scheduler.stats.num_steps > len(reference[0]) // 5
    finally:
        llm.shutdown()


def test_server_sends_prompt_logprobs_once_in_the_first_message(server, reference):
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K, n=2)
    messages = list(server.stub.Generate(generate_pb2.GenerateRequest(
        text=PROMPT, sampling=sampling), timeout=120))
    with_prompt = [m for m in messages if m.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0] is messages[0]
    entries = with_prompt[0].prompt_logprobs
    ids, logprobs = reference
    assert [e.token_id for e in entries] == ids[1:]
    assert all(len(e.top_logprobs) == K for e in entries)
    assert max(abs(e.logprob - float(logprobs[p, ids[p + 1]]))
               for p, e in enumerate(entries)) < TOLERANCE
