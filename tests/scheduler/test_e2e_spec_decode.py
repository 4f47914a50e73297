"""Speculative decoding end to end on the embedded SmolLM2 in float32: greedy output with n-gram
drafts is token-identical to the same engine without them, and to transformers, for prompts that
repeat themselves (most drafts accepted) and ordinary ones, with chunked prefill, requests
joining mid-run and a KV pool small enough to preempt (the settings of e2e_llm)."""

from __future__ import annotations

import pytest

from scheduler_svc import LLM, SamplingParams
from tests.parity import hf_greedy

from .conftest import E2E_NUM_BLOCKS
from .test_e2e_default_model import PROMPTS as ORDINARY
from .test_e2e_default_model import check_parity

pytestmark = pytest.mark.slow

REPEATING = [
    "Copy the list exactly.\nList: red, green, blue, yellow, purple, orange, white, black\n"
    "Copy: red, green,",
    "def area(width, height):\n    result = width * height\n    print(result)\n    return result"
    "\n\n\ndef area(width, height):\n    result = width * height\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2,",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15.\nAgain: 1, 2, 3,",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def spec_llm(default_tokenizer):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # as e2e_llm: fp32 K and V of 16 tokens, 30 layers
    llm = LLM(dtype="float32", tokenizer=default_tokenizer,
              kv_cache_memory_bytes=E2E_NUM_BLOCKS * block_bytes, max_model_len=96,
              max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16,
              speculative_method="ngram", num_speculative_tokens=4)
    yield llm
    llm.shutdown()


def generate(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(e2e_llm) -> dict[str, list[int]]:
    """Each prompt's tokens from the same engine without drafts, run once for the module (the
    LLM tokenizes a text prompt as default_tokenizer(p).input_ids, which the last test sends)."""
    return dict(zip(REPEATING + ORDINARY, generate(e2e_llm, REPEATING) +
                    generate(e2e_llm, ORDINARY), strict=True))


def check_idle(llm):
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_blocks - 1, "blocks leaked"


def test_repeating_prompts_accept_most_drafts_and_match(spec_llm, plain, hf_default_model,
                                                        default_tokenizer):
    ids = [default_tokenizer(p).input_ids for p in REPEATING]
    stats = spec_llm.engine.scheduler.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    ours = generate(spec_llm, REPEATING)
    drafted = stats.num_draft_tokens - before[0]
    accepted = stats.num_accepted_tokens - before[1]
    print(f"repeating prompts: {accepted}/{drafted} drafts accepted")
    assert drafted >= 40 and accepted / drafted > 0.7
    assert ours == [plain[p] for p in REPEATING]
    check_parity(hf_default_model, ids, ours, [hf_greedy(hf_default_model, p, MAX_TOKENS)
                                               for p in ids])
    check_idle(spec_llm)


def test_ordinary_prompts_with_preemption_match(spec_llm, plain):
    stats = spec_llm.engine.scheduler.stats
    preemptions = stats.num_preemptions
    ours = generate(spec_llm, ORDINARY)
    assert stats.num_preemptions > preemptions, "the small KV pool should have preempted"
    assert ours == [plain[p] for p in ORDINARY]
    check_idle(spec_llm)


def test_requests_joining_mid_run_match(spec_llm, plain, default_tokenizer):
    prompts = REPEATING[:3] + ORDINARY[:2]
    ids = [default_tokenizer(p).input_ids for p in prompts]
    engine = spec_llm.engine
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(ids))}
    step = 0
    while step < len(ids) or engine.has_requests():
        if step < len(ids):  # one new request per step, joining a batch that is drafting
            engine.add_request(ids[step], GREEDY, request_id=f"join-{step}")
        for out in engine.step():
            tokens[out.request_id.removeprefix("join-")] += out.new_token_ids
        step += 1
    assert [tokens[str(i)] for i in range(len(ids))] == [plain[p] for p in prompts]
    check_idle(spec_llm)
