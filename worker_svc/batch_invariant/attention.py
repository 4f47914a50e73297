"""Paged attention whose result for a query token depends on nothing but its own request's keys.

The default CPU path (`kernels/paged_attention_cpu.py`) groups decode rows by length and pads
their keys to the group's longest, and attends a prompt chunk's queries together: a token's
scores then come from a matmul whose shape depends on its neighbours and on how its prompt was
chunked. Here every query token is attended alone, the same way wherever it comes from (a
decode step, a prefill chunk of any length, the one recomputed token of a prefix-cache hit):
- its keys are read in fixed tiles of KEY_TILE positions from position 0 up to its own
  (tile j always covers positions [j * KEY_TILE, (j + 1) * KEY_TILE) of its request);
- tile by tile, in that order, an online softmax in float32: scores by one [GQA group, hd] x
  [hd, KEY_TILE] matmul per (token, KV head), then the running max, sum and output, whose
  update by a tile holds exact zeros for masked keys;
- the matmuls of all tokens that need tile j run as one bmm of such fixed-shape items (a bmm
  gives each item the same bits whatever the number of items: `row_invariance.py`).
Keys past the token's position are masked to -inf, so a later key's value (written or stale)
never reaches it. The sum of each tile's probabilities comes out of the same matmul as the
output (a column of ones beside V), not from a reduction whose split could follow the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire.kernels.attention_metadata import AttentionMetadata

KEY_TILE = 128  # key positions per online-softmax step; fewer steps, fewer per-op costs


@dataclasses.dataclass(slots=True)
class KeyTileRound:
    """Tile j of every token that reaches it: the first `num_tokens` tokens in `order`."""

    num_tokens: int
    slots: torch.Tensor  # [num_tokens * KEY_TILE] int64 cache slots (0 where masked)
    bias: torch.Tensor  # [num_tokens, 1, 1, KEY_TILE] float32: 0 attend, -inf masked


@dataclasses.dataclass(slots=True)
class InvariantPlan:
    """The step's layout, built by the first layer and reused by the others."""

    block_size: int
    order: torch.Tensor  # [num_actual_tokens] token indices, most key tiles first
    rounds: list[KeyTileRound]


def build_plan(metadata: AttentionMetadata, block_size: int) -> InvariantPlan:
    device = metadata.block_table.device
    qsl = metadata.query_start_loc_cpu.astype(np.int64)  # [num_reqs + 1]
    seq_lens = metadata.seq_lens_cpu.astype(np.int64)  # [num_reqs]
    query_lens = qsl[1:] - qsl[:-1]  # [num_reqs]
    req = np.repeat(np.arange(len(seq_lens)), query_lens)  # [tokens] per token
    # Token t of request r sits at position seq_len - query_len + (t - qsl[r]).
    pos = np.arange(len(req)) - qsl[req] + seq_lens[req] - query_lens[req]  # [tokens]
    num_tiles = pos // KEY_TILE + 1  # [tokens] key tiles each token reads
    order = np.argsort(-num_tiles, kind="stable")  # [tokens]
    req, pos, num_tiles = req[order], pos[order], num_tiles[order]
    table = metadata.block_table.cpu().numpy().astype(np.int64)  # [num_reqs, max_blocks]
    rounds = []
    for j in range(int(num_tiles.max()) if len(order) else 0):
        count = int(np.count_nonzero(num_tiles > j))
        key_pos = j * KEY_TILE + np.arange(KEY_TILE)  # [KEY_TILE]
        visible = key_pos[None, :] <= pos[:count, None]  # [count, KEY_TILE]
        # A masked key reads slot 0: block-table entries past a request's length may be garbage.
        block_col = np.minimum(key_pos // block_size, table.shape[1] - 1)
        slots = table[req[:count, None], block_col[None, :]] * block_size + key_pos % block_size
        slots = np.where(visible, slots, 0)
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        rounds.append(KeyTileRound(
            count,
            torch.from_numpy(slots.reshape(-1)).to(device),
            torch.from_numpy(bias).view(count, 1, 1, KEY_TILE).to(device),
        ))
    return InvariantPlan(block_size, torch.from_numpy(order).to(device), rounds)


def paged_attention_invariant(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The signature and result of `kernels.paged_attention`; padding rows are zero."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    plan = metadata.plan
    if not isinstance(plan, InvariantPlan) or plan.block_size != block_size:
        plan = metadata.plan = build_plan(metadata, block_size)
    out = torch.zeros_like(query)
    num_tokens = len(plan.order)
    if num_tokens == 0:
        return out
    group = query.shape[1] // num_kv_heads
    # [tokens, nq, hd] -> [tokens * nkv, g, hd], in the plan's order, scaled in float32
    q = (query[plan.order].float() * scale).view(num_tokens * num_kv_heads, group, head_dim)
    row_max = torch.full((num_tokens * num_kv_heads, group, 1), float("-inf"), device=q.device)
    acc = torch.zeros(num_tokens * num_kv_heads, group, head_dim + 1, device=q.device)
    keys = k_cache.view(-1, num_kv_heads, head_dim)  # [slots, nkv, hd]
    values = v_cache.view(-1, num_kv_heads, head_dim)
    for tile in plan.rounds:
        n = tile.num_tokens * num_kv_heads  # items: (token, KV head)
        k = _tile_of(keys, tile, num_kv_heads)  # [n, KEY_TILE, hd]
        v = torch.cat(  # [n, KEY_TILE, hd + 1]: the ones column sums the probabilities
            (_tile_of(values, tile, num_kv_heads), k.new_ones(n, KEY_TILE, 1)), dim=-1
        )
        scores = torch.bmm(q[:n], k.transpose(1, 2))  # [n, g, KEY_TILE]
        scores.view(tile.num_tokens, num_kv_heads, group, KEY_TILE).add_(tile.bias)
        # Every token that reads tile j sees its first key, so the new max is finite.
        new_max = torch.maximum(row_max[:n], scores.amax(dim=-1, keepdim=True))  # [n, g, 1]
        probs = torch.exp(scores - new_max)  # [n, g, KEY_TILE]
        acc[:n] = acc[:n] * torch.exp(row_max[:n] - new_max) + torch.bmm(probs, v)
        row_max[:n] = new_max
    result = acc[..., :head_dim] / acc[..., head_dim:]  # [tokens * nkv, g, hd]
    out[plan.order] = result.view(num_tokens, -1, head_dim).to(query.dtype)
    return out


def _tile_of(cache: torch.Tensor, tile: KeyTileRound, num_kv_heads: int) -> torch.Tensor:
    """cache [slots, nkv, hd] -> the round's keys, [tokens * nkv, KEY_TILE, hd] float32."""
    head_dim = cache.shape[-1]
    rows = cache.index_select(0, tile.slots).float()  # [tokens * KEY_TILE, nkv, hd]
    rows = rows.view(tile.num_tokens, KEY_TILE, num_kv_heads, head_dim).transpose(1, 2)
    return rows.reshape(tile.num_tokens * num_kv_heads, KEY_TILE, head_dim)
