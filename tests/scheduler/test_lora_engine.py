"""The offline API with LoRA adapters on the tiny Llama: each request gets its own adapter's
greedy tokens (transformers + PEFT's), the same prompt under two adapters shares no cached
prefix, and an adapter the worker cannot read fails its request alone."""

from __future__ import annotations

import pytest
from batchwire import LLM, LoRARequest, SamplingParams

from tests.lora_adapters import make_adapter, peft_greedy
from tests.parity import assert_greedy_parity

PROMPT = [(7 * i + 3) % 500 for i in range(40)]  # two full blocks of 16, then a part
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_with_tokenizer, tmp_path_factory):
    base = tiny_llama_with_tokenizer
    paths = {r: make_adapter(base, tmp_path_factory.mktemp(f"offline{r}"), r, r) for r in (8, 16)}
    llm = LLM(base, dtype="float32", max_loras=2, max_lora_rank=16, max_model_len=256,
              kv_cache_memory_bytes=4 << 20, block_size=16)
    yield llm, paths
    llm.shutdown()


def test_each_request_runs_with_its_own_adapter(lora_llm, tiny_llama_with_tokenizer):
    llm, paths = lora_llm
    loras = {r: LoRARequest(f"rank{r}", r, path) for r, path in paths.items()}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # One after another, the same prompt: a prefix cached under one adapter must not serve
    # the next (its KV would be another model's).
    runs = [(None, llm.generate([PROMPT], greedy, use_tqdm=False)[0])]
    for r in (8, 16):
        runs.append((r, llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=loras[r])[0]))
    # And all three in one batch.
    mixed = llm.generate([PROMPT] * 3, greedy, use_tqdm=False,
                         lora_request=[None, loras[8], loras[16]])
    for (rank, alone), together in zip(runs, mixed, strict=True):
        model, ref = peft_greedy(tiny_llama_with_tokenizer, paths.get(rank), PROMPT, MAX_TOKENS)
        assert_greedy_parity(model, PROMPT, alone.token_ids, ref)
        assert together.token_ids == alone.token_ids
    assert len({tuple(out.token_ids) for _, out in runs}) == 3


def test_an_unreadable_adapter_fails_its_request_alone(lora_llm, tmp_path):
    llm, paths = lora_llm
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = LoRARequest("missing", 99, str(tmp_path / "no-such-adapter"))
    fine, refused = llm.generate([PROMPT, PROMPT[:20]], greedy, use_tqdm=False,
                                 lora_request=[LoRARequest("rank8", 8, paths[8]), bad])
    assert fine.finish_reason == "length" and len(fine.token_ids) == 4
    assert refused.finish_reason == "abort" and refused.token_ids == []
    assert "lora_path" in refused.error and "no adapter_config.json" in refused.error


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/a")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
