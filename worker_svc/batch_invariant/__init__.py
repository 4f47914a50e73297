"""Batch-invariant mode (`--batch-invariant`): a request's tokens and logprobs, bit for bit, do
not depend on the other requests of its steps, on how its prompt was chunked or on a prefix-cache
hit. Off by default; it costs speed (docs/performance.md).

What varied, measured by `benchmarks/engine/row_invariance.py` on a CPU: the float32 linears
(a row's bits change with the number of rows M) and the attention path's shapes (decode rows
padded to their group's longest, a prompt chunk's queries attended together). What did not
vary and stays as it is: RMSNorm, rotary, the activation, log_softmax and the argmax, each
computed row by row. `enable` swaps the first two for fixed-shape versions:
- `linear.py`: every linear over fixed [ROW_TILE, K] row tiles;
- `attention.py`: every query token at a fixed row of a fixed query tile, over fixed key tiles
  in a fixed order.
"""

from __future__ import annotations

from worker_svc.batch_invariant.attention import paged_attention_invariant
from worker_svc.batch_invariant.linear import tile_linears
from worker_svc.models.llama import LlamaForCausalLM


def enable(model: LlamaForCausalLM) -> None:
    """Makes every row of model's forward pass independent of the batch around it, in place."""
    tile_linears(model)
    for attention in model.attention_layers():
        attention.attend = paged_attention_invariant
