"""Paged attention whose result for a query token depends on nothing but its own request's keys.

The default CPU path (`kernels/paged_attention_cpu.py`) groups decode rows by length and pads
their keys to the group's longest, and attends a prompt chunk's queries together: a token's
scores then come from a matmul whose shape depends on its neighbours and on how its prompt was
chunked. Here every query token is attended the same way wherever it comes from (a decode step,
a prefill chunk of any length, the one recomputed token of a prefix-cache hit):
- it sits in a fixed query tile of its request: positions [i * QUERY_TILE, (i + 1) * QUERY_TILE),
  always at the same row; rows of the tile that this step does not compute are zeros, and a
  matmul of a fixed shape gives a row the same bits whatever the other rows hold;
- the tile's keys are read in fixed key tiles of KEY_TILE positions from position 0 up (tile j
  always covers positions [j * KEY_TILE, (j + 1) * KEY_TILE) of its request), read once for all
  the tile's query tokens (the gather and copy of keys per query token were 90% of the time);
- key tile by key tile, in that order, an online softmax in float32: scores by one
  [QUERY_TILE x GQA group, hd] x [hd, KEY_TILE] matmul per (query tile, KV head), then the
  running max, sum and output, whose update by a key tile holds exact zeros for masked keys;
- the matmuls of all query tiles that need key tile j run as one bmm of such fixed-shape items
  (a bmm gives each item the same bits whatever the number of items: `row_invariance.py`).
KEY_TILE is a multiple of QUERY_TILE, so every row of a query tile reads the same key tiles, and
each row's first key of each of them is visible to it: its running max stays finite.
Keys past a row's position are masked to -inf; keys past its request's length are read from
slot 0 (block-table entries there may be garbage). The sum of each tile's probabilities comes out
of the same matmul as the output (a column of ones beside V), not from a reduction whose split
could follow the batch.

NOTE: a decode token pays for a whole query tile's rows (QUERY_TILE x one row's matmul and
softmax work), while a prompt's tokens share each gathered key tile.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire.kernels.attention_metadata import AttentionMetadata

KEY_TILE = 128  # key positions per online-softmax step; fewer steps, fewer per-op costs
# Query positions sharing one gathered key tile; divides KEY_TILE. 8, measured against 4 and 16
# (docs/performance.md): a prompt chunk's attention ~9x faster than one token at a time, a
# decode step ~1.6x slower (8 rows computed for 1).
QUERY_TILE = 8
assert KEY_TILE % QUERY_TILE == 0


@dataclasses.dataclass(slots=True)
class KeyTileRound:
    """Key tile j of every query tile that reaches it: the first `num_items` in the plan."""

    num_items: int
    slots: torch.Tensor  # [num_items * KEY_TILE] int64 cache slots (0 past the request's length)
    bias: torch.Tensor  # [num_items, 1, QUERY_TILE, 1, KEY_TILE] float32: 0 attend, -inf masked


@dataclasses.dataclass(slots=True)
class InvariantPlan:
    """The step's layout, built by the first layer and reused by the others."""

    block_size: int
    num_items: int  # query tiles, most key tiles first
    token_rows: torch.Tensor  # [num_actual_tokens] each token's row among num_items * QUERY_TILE
    rounds: list[KeyTileRound]


def build_plan(metadata: AttentionMetadata, block_size: int) -> InvariantPlan:
    device = metadata.block_table.device
    qsl = metadata.query_start_loc_cpu.astype(np.int64)  # [num_reqs + 1]
    seq_lens = metadata.seq_lens_cpu.astype(np.int64)  # [num_reqs]
    query_lens = qsl[1:] - qsl[:-1]  # [num_reqs]
    req = np.repeat(np.arange(len(seq_lens)), query_lens)  # [tokens] per token
    # Token t of request r sits at position seq_len - query_len + (t - qsl[r]).
    pos = np.arange(len(req)) - qsl[req] + seq_lens[req] - query_lens[req]  # [tokens]
    # The query tiles the step touches, (request, tile index) each, most key tiles first.
    items, token_item = np.unique(req * (1 << 32) + pos // QUERY_TILE, return_inverse=True)
    item_req, item_start = items >> 32, (items & 0xFFFFFFFF) * QUERY_TILE  # [items]
    num_tiles = item_start // KEY_TILE + 1  # [items] key tiles each reads
    order = np.argsort(-num_tiles, kind="stable")  # [items]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    token_rows = rank[token_item.reshape(-1)] * QUERY_TILE + pos % QUERY_TILE  # [tokens]
    item_req, item_start, num_tiles = item_req[order], item_start[order], num_tiles[order]
    row_pos = item_start[:, None] + np.arange(QUERY_TILE)  # [items, QUERY_TILE]
    table = metadata.block_table.cpu().numpy().astype(np.int64)  # [num_reqs, max_blocks]
    rounds = []
    for j in range(int(num_tiles.max()) if len(order) else 0):
        count = int(np.count_nonzero(num_tiles > j))
        key_pos = j * KEY_TILE + np.arange(KEY_TILE)  # [KEY_TILE]
        block_col = np.minimum(key_pos // block_size, table.shape[1] - 1)
        slots = table[item_req[:count, None], block_col[None, :]] * block_size
        slots += key_pos % block_size  # [count, KEY_TILE]
        slots = np.where(key_pos[None, :] < seq_lens[item_req[:count], None], slots, 0)
        visible = key_pos[None, None, :] <= row_pos[:count, :, None]  # [count, QT, KEY_TILE]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        rounds.append(KeyTileRound(
            count,
            torch.from_numpy(slots.reshape(-1)).to(device),
            torch.from_numpy(bias).view(count, 1, QUERY_TILE, 1, KEY_TILE).to(device),
        ))
    return InvariantPlan(block_size, len(order), torch.from_numpy(token_rows).to(device), rounds)


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
    num_tokens = len(plan.token_rows)
    if num_tokens == 0:
        return out
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    rows = plan.num_items * QUERY_TILE  # query tiles' rows; those this step lacks stay zero
    q = query.new_zeros(rows, num_q_heads, head_dim, dtype=torch.float32)
    q[plan.token_rows] = query[:num_tokens].float() * scale
    # [items, QT, nkv, g, hd] -> [items * nkv, QT * g, hd]: one item per (query tile, KV head)
    q = q.view(plan.num_items, QUERY_TILE, num_kv_heads, group, head_dim).transpose(1, 2)
    q = q.reshape(plan.num_items * num_kv_heads, QUERY_TILE * group, head_dim)
    row_max = torch.full((*q.shape[:2], 1), float("-inf"), device=q.device)
    acc = q.new_zeros(*q.shape[:2], head_dim + 1)
    keys = k_cache.view(-1, num_kv_heads, head_dim)  # [slots, nkv, hd]
    values = v_cache.view(-1, num_kv_heads, head_dim)
    for tile in plan.rounds:
        n = tile.num_items * num_kv_heads
        k = _tile_of(keys, tile, num_kv_heads)  # [n, KEY_TILE, hd]
        v = torch.cat(  # [n, KEY_TILE, hd + 1]: the ones column sums the probabilities
            (_tile_of(values, tile, num_kv_heads), k.new_ones(n, KEY_TILE, 1)), dim=-1
        )
        scores = torch.bmm(q[:n], k.transpose(1, 2))  # [n, QT * g, KEY_TILE]
        shape = (tile.num_items, num_kv_heads, QUERY_TILE, group, KEY_TILE)
        scores.view(shape).add_(tile.bias)
        new_max = torch.maximum(row_max[:n], scores.amax(dim=-1, keepdim=True))  # [n, QT*g, 1]
        probs = torch.exp(scores - new_max)  # [n, QT * g, KEY_TILE]
        acc[:n] = acc[:n] * torch.exp(row_max[:n] - new_max) + torch.bmm(probs, v)
        row_max[:n] = new_max
    result = acc[..., :head_dim] / acc[..., head_dim:]  # [items * nkv, QT * g, hd]
    result = result.view(plan.num_items, num_kv_heads, QUERY_TILE, group, head_dim).transpose(1, 2)
    result = result.reshape(rows, num_q_heads, head_dim)
    out[:num_tokens] = result[plan.token_rows].to(query.dtype)
    return out


def _tile_of(cache: torch.Tensor, tile: KeyTileRound, num_kv_heads: int) -> torch.Tensor:
    """cache [slots, nkv, hd] -> the round's keys, [items * nkv, KEY_TILE, hd] float32."""
    head_dim = cache.shape[-1]
    rows = cache.index_select(0, tile.slots).float()  # [items * KEY_TILE, nkv, hd]
    rows = rows.view(tile.num_items, KEY_TILE, num_kv_heads, head_dim).transpose(1, 2)
    return rows.reshape(tile.num_items * num_kv_heads, KEY_TILE, head_dim)
