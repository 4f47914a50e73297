"""n samples of one prompt as n requests of one sequence each.

The n children carry the same prompt and are queued together, so the first to be scheduled
allocates the prompt's blocks and the others find its full blocks in the prefix cache (blocks
become findable as soon as they are scheduled): the prompt is prefilled once, its blocks are
reference-counted by the block pool and go back when the last child lets go of them.
"""

from __future__ import annotations

import dataclasses
import hashlib

from scheduler_svc.core.sampling_params import SamplingParams


def child_seed(seed: int, index: int) -> int:
    """Sequence 0 keeps the seed (n = 1 is unchanged); the others get a 64-bit hash of
    (seed, index), so that their draws are reproducible and differ from each other's."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"batchwire-seq:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s parameters: one sequence, its own seed. Prompt logprobs are asked of
    sequence 0 only: the others then hit the prompt blocks it caches instead of recomputing."""
    seed = None if params.seed is None else child_seed(params.seed, index)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id of one sequence; clients see the parent's id and the sequence's index."""
    return f"{request_id}#{index}"
