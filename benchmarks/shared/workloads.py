"""The workloads every comparison shares: W64, a fixed-length random one, a shared-prefix one.

A workload is a list of (prompt token ids, output length); prompts are token ids, so no
tokenizer sits between two engines being compared.
"""

from __future__ import annotations

import random

Workload = list[tuple[list[int], int]]
LOW_ID, HIGH_ID = 100, 49000  # prompt token ids drawn uniformly from [LOW_ID, HIGH_ID)


def w64(seed: int = 0, n: int = 64) -> Workload:
    """W64 (design brief): prompt lengths uniform in [32, 256], outputs uniform in [16, 128]."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt_len = rng.randint(32, 256)
        prompt = [rng.randrange(LOW_ID, HIGH_ID) for _ in range(prompt_len)]
        reqs.append((prompt, rng.randint(16, 128)))
    return reqs


def random_fixed(num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    """Every prompt input_len random ids long, every output output_len tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(LOW_ID, HIGH_ID) for _ in range(input_len)], output_len)
            for _ in range(num_prompts)]


def shared_prefix(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                  seed: int = 0) -> Workload:
    """One prefix_len-token prefix shared by all, then suffix_len ids of each request's own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(LOW_ID, HIGH_ID) for _ in range(prefix_len)]
    return [(prefix + [rng.randrange(LOW_ID, HIGH_ID) for _ in range(suffix_len)], output_len)
            for _ in range(num_prompts)]


def token_counts(workload: Workload) -> tuple[int, int]:
    """(prompt tokens, output tokens) of the whole workload."""
    return sum(len(p) for p, _ in workload), sum(n for _, n in workload)
