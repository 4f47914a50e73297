"""The torch path of paged attention, the one that serves CPU workers.

A step's rows split into decode rows (one query token) and prefill rows (a prompt chunk that
attends to its cached prefix and causally to itself). The split and every index tensor are
built once per step into an `AttentionPlan` that all layers reuse (`metadata.plan`):
- decode rows are batched: sorted into a few groups of similar length (so padding at most
  doubles the keys read), each group's K/V blocks gathered head-major with one index_select
  into [kv_heads, rows, max_blocks * block_size, head_dim] and attended with two batched
  matmuls around a softmax under a length bias, the GQA group of query heads standing in as
  the matmul's rows (no K/V head expansion). NOTE: CPU SDPA costs ~3x more at this shape (a
  query length of one GQA group); the matmuls need each head's keys contiguous, hence the
  head-major gather;
- prefill rows (few per step) are attended the same way one at a time, in chunks of query
  rows, under a causal bias that counts the cached prefix.
Scores come out of the matmul in the cache's dtype and are softmaxed in float32 (as
transformers' eager attention does); float32 caches stay float32 throughout. Few ops per
group: at small batches each op's fixed cost is what a decode step pays.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire.kernels.attention_metadata import AttentionMetadata

# Query rows of a prompt attended at once: bounds the float32 scores to
# [num_q_heads, PREFILL_QUERY_CHUNK, seq_len].
PREFILL_QUERY_CHUNK = 256


@dataclasses.dataclass(slots=True)
class DecodeGroup:
    num_rows: int
    tokens: torch.Tensor | slice  # [num_rows] int64 token indices, a slice when contiguous
    blocks: torch.Tensor  # [num_rows * max_blocks] int64 cache blocks, 0 past a row's seq_len
    bias: torch.Tensor  # [num_rows, 1, max_blocks * block_size] float32: 0 attend, -inf not
    # [nkv * num_rows * max_blocks] the blocks as rows of the head-major cache seen as
    # [nkv * num_blocks, block_size, hd]; set by the first layer (all caches share a shape).
    head_blocks: torch.Tensor | None = None
    # One row whose blocks are consecutive ids (first, seq_len): its keys are read in place,
    # as a view of the head-major cache, with no gather and no bias. None otherwise.
    run: tuple[int, int] | None = None


@dataclasses.dataclass(slots=True)
class PrefillRow:
    start: int  # first token of the request in the step's token dim
    end: int
    slots: torch.Tensor  # [seq_len] int64: cache slot of every key position
    bias: torch.Tensor  # [query_len, seq_len] float32: 0 attend, -inf not (causal after the prefix)
    head_slots: torch.Tensor | None = None  # [nkv * seq_len], as DecodeGroup.head_blocks


@dataclasses.dataclass(slots=True)
class AttentionPlan:
    block_size: int
    num_actual_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillRow]
    # Gather buffers reused by every layer: fresh ones per layer cost page faults on CPU.
    workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )

    def gather_buffers(
        self, group: int, k_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [kv_heads, rows * max_blocks, block_size, head_dim]: each head's keys contiguous
        num_blocks = self.decode_groups[group].blocks.numel()
        shape = (k_cache.shape[2], num_blocks, k_cache.shape[1], k_cache.shape[3])
        key = (group, k_cache.dtype, k_cache.device, shape)
        if key not in self.workspace:
            buffer = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self.workspace[key] = (buffer, torch.empty_like(buffer))
        return self.workspace[key]


def _as_slice(tokens: np.ndarray) -> slice | None:
    if len(tokens) and tokens[-1] - tokens[0] == len(tokens) - 1:
        return slice(int(tokens[0]), int(tokens[-1]) + 1)
    return None


def _split_by_length(num_blocks: np.ndarray) -> list[np.ndarray]:
    """Row indices in groups where every row needs more than half the group's longest row."""
    order = np.argsort(-num_blocks, kind="stable")
    groups, first = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or 2 * num_blocks[order[i]] <= num_blocks[order[first]]:
            groups.append(np.sort(order[first:i]))  # token order: sequential writes
            first = i
    return groups


def _decode_group(
    metadata: AttentionMetadata, reqs_np: np.ndarray, tokens_np: np.ndarray, block_size: int
) -> DecodeGroup:
    device = metadata.block_table.device
    seq_lens = metadata.seq_lens_cpu[reqs_np].astype(np.int64)
    max_blocks = int(-(-seq_lens.max() // block_size))
    reqs = torch.from_numpy(reqs_np).to(device)
    lens = torch.from_numpy(seq_lens).to(device)  # [rows]
    # Block ids past a row's length may be garbage (even out of range): replace them by block 0.
    table = metadata.block_table.index_select(0, reqs)[:, :max_blocks].long()
    block_start = torch.arange(max_blocks, device=device) * block_size  # [max_blocks]
    table = table.masked_fill(block_start >= lens[:, None], 0)  # [rows, max_blocks]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    tokens = _as_slice(tokens_np)
    return DecodeGroup(
        num_rows=len(reqs_np),
        tokens=tokens if tokens is not None else torch.from_numpy(tokens_np).to(device),
        blocks=table.reshape(-1),
        bias=torch.zeros(len(reqs_np), 1, len(key_pos), device=device).masked_fill_(
            (key_pos >= lens[:, None])[:, None, :], float("-inf")
        ),
        run=_one_run(table, int(seq_lens[0])) if len(reqs_np) == 1 else None,
    )


def _one_run(table: torch.Tensor, seq_len: int) -> tuple[int, int] | None:
    """(first block, seq_len) when a single row's blocks are consecutive ids on CPU: the block
    allocator hands a lone stream's blocks out in order from a fresh pool."""
    if table.device.type != "cpu":
        return None
    blocks = table[0].numpy()
    first = int(blocks[0])
    return (first, seq_len) if bool((np.diff(blocks) == 1).all()) else None


def build_plan(metadata: AttentionMetadata, block_size: int) -> AttentionPlan:
    device = metadata.block_table.device
    qsl = metadata.query_start_loc_cpu.astype(np.int64)  # [num_reqs + 1]
    seq_lens = metadata.seq_lens_cpu.astype(np.int64)  # [num_reqs]
    query_lens = qsl[1:] - qsl[:-1]  # [num_reqs]

    decode_reqs = np.flatnonzero(query_lens == 1)  # per request
    decode_groups = [
        _decode_group(metadata, decode_reqs[rows], qsl[decode_reqs[rows]], block_size)
        for rows in _split_by_length(-(-seq_lens[decode_reqs] // block_size))
    ]

    prefills = []
    for r in np.flatnonzero(query_lens > 1):
        query_len, seq_len = int(query_lens[r]), int(seq_lens[r])
        pos = torch.arange(seq_len, device=device)  # [seq_len] key positions
        blocks = metadata.block_table[r, : -(-seq_len // block_size)].long()
        slots = blocks[pos // block_size] * block_size + pos % block_size
        # Query i sits at position seq_len - query_len + i and sees keys up to it.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        bias = torch.zeros(query_len, seq_len, device=device)
        bias.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        prefills.append(PrefillRow(int(qsl[r]), int(qsl[r + 1]), slots, bias))

    return AttentionPlan(block_size, int(qsl[-1]), decode_groups, prefills)


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    plan = metadata.plan
    if not isinstance(plan, AttentionPlan) or plan.block_size != block_size:
        plan = metadata.plan = build_plan(metadata, block_size)
    out = torch.empty_like(query)
    if plan.num_actual_tokens < query.shape[0]:
        out[plan.num_actual_tokens :].zero_()  # padding rows: defined, never read
    for i in range(len(plan.decode_groups)):
        _decode(query, k_cache, v_cache, plan, i, scale, out)
    for row in plan.prefills:
        _prefill(query, k_cache, v_cache, row, scale, out)
    return out


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    group_index: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    group = plan.decode_groups[group_index]
    rows = group.num_rows
    _, _, num_kv_heads, head_dim = k_cache.shape
    kv_group = query.shape[1] // num_kv_heads
    if group.run is not None and k_cache.permute(2, 0, 1, 3).is_contiguous():
        _decode_in_place(query, k_cache, v_cache, group, group.run, scale, out)
        return
    k, v = plan.gather_buffers(group_index, k_cache)
    if group.head_blocks is None:
        group.head_blocks = _every_head(group.blocks, num_kv_heads, k_cache.shape[0])
    _gather_head_major(k_cache, group.blocks, group.head_blocks, k)
    _gather_head_major(v_cache, group.blocks, group.head_blocks, v)
    k = k.view(num_kv_heads * rows, -1, head_dim)  # [nkv * rows, max_len, hd]
    v = v.view(num_kv_heads * rows, -1, head_dim)
    # [rows, nq, hd] -> [nkv, rows, nq/nkv, hd]
    q = query[group.tokens].view(rows, num_kv_heads, kv_group, head_dim).transpose(0, 1)
    q = _scaled_copy(q, scale).view(num_kv_heads * rows, kv_group, head_dim)
    scores = torch.bmm(q, k.transpose(1, 2))  # [nkv * rows, nq/nkv, max_len]
    scores.view(num_kv_heads, rows, kv_group, -1).add_(group.bias)
    o = torch.bmm(scores.softmax(dim=-1), v)  # [nkv * rows, nq/nkv, hd]
    o = o.view(num_kv_heads, rows, kv_group, head_dim).transpose(0, 1)  # [rows, nkv, g, hd]
    if isinstance(group.tokens, slice):
        out[group.tokens].view(rows, num_kv_heads, kv_group, head_dim).copy_(o)
    else:
        out[group.tokens] = o.reshape(rows, -1, head_dim)  # [rows, nq, hd]


def _decode_in_place(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    run: tuple[int, int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One decode row whose blocks are consecutive: its keys and values are views of the
    head-major cache, [nkv, seq_len, hd], cut at seq_len (so no bias either)."""
    first, seq_len = run
    assert isinstance(group.tokens, slice), "a single row's token is a slice"
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    n = -(-seq_len // block_size)
    k, v = (
        c.permute(2, 0, 1, 3)[:, first : first + n].view(num_kv_heads, -1, head_dim)[:, :seq_len]
        for c in (k_cache, v_cache)
    )  # views: the storage is [nkv, num_blocks, block_size, hd]
    q = query[group.tokens].view(num_kv_heads, -1, head_dim)  # [nkv, nq/nkv, hd]
    scores = torch.bmm(_scaled_copy(q, scale), k.transpose(1, 2))  # [nkv, nq/nkv, seq_len]
    o = torch.bmm(scores.softmax(dim=-1), v)  # [nkv, nq/nkv, hd]
    out[group.tokens].view(num_kv_heads, -1, head_dim).copy_(o)


def _scaled_copy(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A contiguous copy of x times scale: the query copy the matmul needs anyway.

    Scaling the query instead of the scores lets the scores stay in the matmul's dtype up to
    the softmax, which reads them in float32; the bias added before it is 0 or -inf, exact in
    any dtype. With a power-of-two scale (head_dim 64, 256) the scores are bit for bit those
    of scaling them afterwards.
    """
    return torch.mul(x, scale, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _every_head(index: torch.Tensor, num_heads: int, head_stride: int) -> torch.Tensor:
    """index [n] into one head's rows -> [num_heads * n] into all heads' rows, head-major."""
    heads = torch.arange(num_heads, device=index.device)[:, None] * head_stride  # [nh, 1]
    return (heads + index[None, :]).reshape(-1)


def _gather_head_major(
    cache: torch.Tensor, blocks: torch.Tensor, head_blocks: torch.Tensor, out: torch.Tensor
) -> None:
    """cache [num_blocks, block_size, nkv, hd] -> out [nkv, len(blocks), block_size, hd]."""
    by_head = cache.permute(2, 0, 1, 3)  # [nkv, num_blocks, block_size, hd], a view
    if by_head.is_contiguous():  # kv_cache_zeros' CPU layout: whole blocks of one head
        # NOTE: along dim 0 of a contiguous tensor index_select is a parallel memcpy; along
        # dim 1 of [nkv, ...] it runs on one thread.
        flat = by_head.view(-1, *by_head.shape[2:])  # [nkv * num_blocks, block_size, hd]
        torch.index_select(flat, 0, head_blocks, out=out.view(-1, *out.shape[2:]))
    else:
        for h in range(cache.shape[2]):
            torch.index_select(cache[:, :, h], 0, blocks, out=out[h])


def _prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    kv_group = query.shape[1] // num_kv_heads
    if row.head_slots is None:
        row.head_slots = _every_head(row.slots, num_kv_heads, k_cache.shape[0] * k_cache.shape[1])
    k = _gather_slots(k_cache, row.slots, row.head_slots)  # [nkv, seq_len, hd]
    v = _gather_slots(v_cache, row.slots, row.head_slots)
    prefix = k.shape[1] - (row.end - row.start)  # cached tokens before this chunk
    for start in range(row.start, row.end, PREFILL_QUERY_CHUNK):
        end = min(start + PREFILL_QUERY_CHUNK, row.end)
        n, seen = end - start, prefix + end - row.start  # queries; keys they can see
        # [n, nq, hd] -> [nkv, nq/nkv * n, hd]
        q = query[start:end].view(n, num_kv_heads, kv_group, head_dim).permute(1, 2, 0, 3)
        q = _scaled_copy(q, scale).view(num_kv_heads, kv_group * n, head_dim)
        scores = torch.bmm(q, k[:, :seen].transpose(1, 2))  # [nkv, g*n, seen]
        bias = row.bias[start - row.start : end - row.start, :seen]  # [n, seen]
        scores.view(num_kv_heads, kv_group, n, seen).add_(bias)
        o = torch.bmm(scores.softmax(dim=-1), v[:, :seen])  # [nkv, g*n, hd]
        out[start:end].view(n, num_kv_heads, kv_group, head_dim).copy_(
            o.view(num_kv_heads, kv_group, n, head_dim).permute(2, 0, 1, 3)
        )  # [n, nq, hd]


def _gather_slots(
    cache: torch.Tensor, slots: torch.Tensor, head_slots: torch.Tensor
) -> torch.Tensor:
    """cache [num_blocks, block_size, nkv, hd] -> [nkv, len(slots), hd]."""
    by_head = cache.permute(2, 0, 1, 3)  # [nkv, num_blocks, block_size, hd], a view
    if by_head.is_contiguous():  # as in _gather_head_major: along dim 0, in parallel
        flat = by_head.reshape(-1, by_head.shape[3])  # [nkv * num_blocks * block_size, hd]
        return flat.index_select(0, head_slots).view(by_head.shape[0], -1, by_head.shape[3])
    return cache.view(-1, *cache.shape[2:]).index_select(0, slots).transpose(0, 1)
