"""PP=2 on the embedded SmolLM2 in float32 (15 layers a stage, two processes started by the
offline API): greedy tokens equal transformers' (tests/parity.py: a near-tie may excuse one)."""

from __future__ import annotations

import pytest

from scheduler_svc import LLM, SamplingParams
from tests.parity import assert_greedy_parity, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def test_two_stages_match_transformers(default_tokenizer, hf_default_model):
    llm = LLM(dtype="float32", tokenizer=default_tokenizer, pipeline_parallel_size=2,
              kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_batched_tokens=256)
    try:
        infos = llm.engine.executor.get_infos()
        assert [(i.pp_rank, i.output_rank) for i in infos] == [(0, 1), (1, 1)]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    notes = []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = default_tokenizer(prompt).input_ids
        ref = hf_greedy(hf_default_model, ids, MAX_TOKENS)
        note = assert_greedy_parity(hf_default_model, ids, out.token_ids, ref)
        if note:
            notes.append(note)
    assert len(notes) <= 1, notes
