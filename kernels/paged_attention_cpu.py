"""The torch path of paged attention, the one that serves CPU workers.

A step's rows split into decode rows (one query token) and prefill rows (a prompt chunk that
attends to its cached prefix and causally to itself). The split and every index tensor are
built once per step into an `AttentionPlan` that all layers reuse (`metadata.plan`):
- decode rows are batched: sorted into a few groups of similar length (so padding at most
  doubles the keys read), each group's K/V blocks gathered with one index_select into
  [rows, max_blocks * block_size] and attended with one SDPA call under a length mask, the GQA
  group of query heads standing in as the query length (no K/V head expansion);
- prefill rows (few per step) get one SDPA call each, causal with the cached prefix as offset.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


@dataclasses.dataclass(slots=True)
class DecodeGroup:
    num_rows: int
    tokens: torch.Tensor | slice  # [num_rows] int64 token indices, a slice when contiguous
    blocks: torch.Tensor  # [num_rows * max_blocks] int64 cache blocks, 0 past a row's seq_len
    mask: torch.Tensor  # [num_rows, 1, 1, max_blocks * block_size] bool, True = attend


@dataclasses.dataclass(slots=True)
class PrefillRow:
    start: int  # first token of the request in the step's token dim
    end: int
    slots: torch.Tensor  # [seq_len] int64: cache slot of every key position
    # [query_len, seq_len] bool, True = attend; None when there is no cached prefix (plain causal).
    mask: torch.Tensor | None


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
        shape = (self.decode_groups[group].blocks.numel(), *k_cache.shape[1:])
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
        mask=(key_pos < lens[:, None])[:, None, None, :],
    )


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
        mask = None
        if seq_len > query_len:
            # Query i sits at position seq_len - query_len + i and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = pos[None, :] <= q_pos[:, None]
        prefills.append(PrefillRow(int(qsl[r]), int(qsl[r + 1]), slots, mask))

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
    q = query[group.tokens].view(rows, num_kv_heads, -1, head_dim)  # [rows, nkv, nq/nkv, hd]
    # [rows * max_blocks, block_size, nkv, hd] -> [rows, nkv, max_len, hd] (a view)
    k, v = plan.gather_buffers(group_index, k_cache)
    torch.index_select(k_cache, 0, group.blocks, out=k)
    torch.index_select(v_cache, 0, group.blocks, out=v)
    k = k.view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
    out[group.tokens] = o.reshape(rows, -1, head_dim)  # [rows, nq, hd]


def _prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, row.slots)  # [seq_len, nkv, hd]
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, row.slots)
    q = query[row.start : row.end].transpose(0, 1)  # [nq, query_len, hd]
    # NOTE: 4-d inputs: CPU SDPA sends 3-d ones to its slow math path (~20x slower here).
    o = F.scaled_dot_product_attention(
        q[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=row.mask,
        is_causal=row.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, nq, query_len, hd]
    out[row.start : row.end] = o[0].transpose(0, 1)
