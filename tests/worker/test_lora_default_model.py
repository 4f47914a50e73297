"""LoRA on the default model (SmolLM2, float32): random PEFT adapters of ranks 8 and 16 give,
through the worker, transformers + PEFT's greedy tokens, each request its own model's in a
batch that mixes both adapters and the base model."""

from __future__ import annotations

import pytest
from batchwire.v1 import worker_pb2 as pb

from tests.lora_adapters import make_adapter, peft_model
from tests.parity import assert_greedy_parity, hf_greedy
from tests.worker.step_driver import StepDriver, greedy

TEXTS = ["The capital of France is", "Once upon a time, in a small village,"]
RANKS = {1: 8, 2: 16}  # lora id -> rank; id 0 is the base model
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(hf_default_model, tmp_path_factory) -> dict[int, str]:
    return {
        i: make_adapter(hf_default_model, tmp_path_factory.mktemp(f"smol-lora{i}"), rank, i)
        for i, rank in RANKS.items()
    }


def test_adapters_and_the_base_mixed_in_one_batch_match_peft(
    default_worker, hf_default_model, default_tokenizer, adapters
):
    prompts = [default_tokenizer(t)["input_ids"] for t in TEXTS]
    sampling = greedy()
    sampling.min_tokens = MAX_TOKENS  # EOS masked, as hf_greedy's min_new_tokens does
    sampling.stop_token_ids.append(default_tokenizer.eos_token_id)
    default_worker.reset()
    driver = StepDriver(default_worker.runner, default_worker.num_blocks, 16, chunk=8)
    for p, prompt in enumerate(prompts):
        for lora_id in (0, *RANKS):
            lora = None
            if lora_id:
                lora = pb.LoRAAdapterRef(id=lora_id, name=f"r{RANKS[lora_id]}",
                                         path=adapters[lora_id])
            driver.add(f"{lora_id}-{p}", prompt, MAX_TOKENS, sampling, lora)
        driver.step()  # the next prompt's requests join while these are mid-prefill
    ours = driver.run()
    notes = []
    for lora_id in (0, *RANKS):
        model = hf_default_model if not lora_id else peft_model(hf_default_model, adapters[lora_id])
        for p, prompt in enumerate(prompts):
            ref = hf_greedy(model, prompt, MAX_TOKENS)
            note = assert_greedy_parity(model, prompt, ours[f"{lora_id}-{p}"], ref)
            if note:
                notes.append(f"adapter {lora_id} prompt {p}: {note}")
    print("\n".join(notes))
    assert len(notes) <= 1, notes  # a near-tie may excuse one answer, not several
    # Each adapter changes every answer: a worker ignoring it would fail the parity above.
    for p in range(len(prompts)):
        assert len({tuple(ours[f"{i}-{p}"]) for i in (0, *RANKS)}) == 3, p
