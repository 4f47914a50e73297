"""Greedy tokens from the runner, driven by hand-built SchedulerOutputs, equal transformers'."""

from __future__ import annotations

import pytest
import transformers

from tests.parity import assert_greedy_parity, hf_greedy
from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import StepDriver, greedy

TINY_PROMPTS = {
    "a": [(7 * i + 3) % 500 for i in range(23)],
    "b": [(11 * i + 1) % 500 for i in range(5)],
    "c": [(13 * i + 2) % 500 for i in range(41)],
    "d": [(17 * i + 9) % 500 for i in range(16)],
}


def drive(runner, prompts: dict[str, list[int]], max_tokens: int, chunk: int, num_blocks: int):
    """Chunked prefill then decode; half the requests join three steps in, so others are mid-run.

    EOS (2) is masked until max_tokens, as hf_greedy's min_new_tokens does on the reference side.
    """
    sampling = greedy()
    sampling.min_tokens = max_tokens
    sampling.stop_token_ids.append(2)
    driver = StepDriver(runner, num_blocks, 16, chunk=chunk)
    ids = list(prompts)
    first, later = ids[: len(ids) // 2], ids[len(ids) // 2 :]
    for r in first:
        driver.add(r, prompts[r], max_tokens, sampling)
    for _ in range(3):
        driver.step()
    for r in later:
        driver.add(r, prompts[r], max_tokens, sampling)
    return driver.run()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_greedy_parity(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    worker = tiny_worker(path)
    ours = drive(worker.runner, TINY_PROMPTS, max_tokens=12, chunk=8, num_blocks=worker.num_blocks)
    for r, prompt in TINY_PROMPTS.items():
        ref = hf_greedy(hf, prompt, 12)
        note = assert_greedy_parity(hf, prompt, ours[r], ref)
        if note:
            print(f"{arch} {r}: {note}")


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colours are",
    "Once upon a time, in a small village,",
    "Explain photosynthesis to a child:",
    "1, 2, 3, 5, 8, 13,",
    "The best way to learn a new language is",
]


def test_default_model_greedy_parity(default_worker, hf_default_model, default_tokenizer):
    prompts = {f"p{i}": default_tokenizer(t)["input_ids"] for i, t in enumerate(PROMPTS)}
    default_worker.reset()
    ours = drive(
        default_worker.runner, prompts, max_tokens=32, chunk=4, num_blocks=default_worker.num_blocks
    )
    notes = []
    for r, prompt in prompts.items():
        ref = hf_greedy(hf_default_model, prompt, 32)
        note = assert_greedy_parity(hf_default_model, prompt, ours[r], ref)
        if note:
            notes.append(f"{r}: {note}")
    print("\n".join(notes))
    # A near-tie may excuse a prompt or two, not most of them.
    assert len(notes) <= 2, notes


def test_a_bfloat16_worker_loads_and_steps_on_any_cpu(tiny_checkpoints):
    """bf16 is the default dtype: it must load on a CPU whose oneDNN lacks a bf16 path too (the
    packed linears are then skipped, see models/packed_linear.py)."""
    worker = tiny_worker(tiny_checkpoints["llama"], dtype="bfloat16")
    assert worker.get_info().dtype == "bfloat16"
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=64)
    driver.add("a", TINY_PROMPTS["a"], 4, greedy())
    assert len(driver.run()["a"]) == 4
