"""Greedy parity against transformers, with the one divergence that is not a bug: a near-tie.

Two correct implementations may order a near-tie of the top two logits differently (float sums
in another order). When outputs first differ, the reference's top-2 gap at that step must be
tiny; the tokens after it are not compared, since each run then continues a different text.
"""

from __future__ import annotations

import torch

NEAR_TIE = 2e-3  # logits; float32 reorderings move them by ~1e-5


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_greedy_parity(model, prompt: list[int], ours: list[int], ref: list[int]) -> str | None:
    """Asserts ours == ref up to a near-tie; returns a note when one was met, else None."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:j]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, (
            f"output differs at token {j} ({a} vs reference {b}) and the reference's top-2 logit "
            f"gap there is {gap:.4f}, not a near-tie"
        )
        return f"near-tie at token {j}: top-2 gap {gap:.2e}; later tokens not compared"
    return None
