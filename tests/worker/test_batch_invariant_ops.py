"""The batch-invariant mode's two ops compute what the default ones do (to rounding), and a row's
bits do not depend on the rows beside it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from batchwire.kernels.kv_cache import kv_cache_zeros
from batchwire.kernels.paged_attention import paged_attention_reference
from torch import nn

from tests.kernels.kernel_factories import ATOL, make_paged_batch
from worker_svc.batch_invariant.attention import (
    KEY_TILE,
    QUERY_TILE,
    paged_attention_invariant,
)
from worker_svc.batch_invariant.linear import ROW_TILE, RowTiledLinear

# (query_lens, seq_lens): decode, prefill, chunks after a cached prefix, key tile boundaries.
BATCHES = [
    ([1], [1]),
    ([5, 1, 17, 1], [37, 32, 50, 1]),
    ([1, 40, 1], [KEY_TILE, KEY_TILE + 40, 2 * KEY_TILE + 1]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize("head_major", [False, True], ids=["plain", "cpu-layout"])
def test_invariant_attention_matches_the_reference(dtype, lens, head_major):
    b = make_paged_batch(*lens, 6, 2, head_dim=32, dtype=dtype, num_padding_tokens=2)
    k_cache, v_cache = b.k_cache, b.v_cache
    if head_major:  # kv_cache_zeros' CPU storage: whole blocks of one head
        k_cache = kv_cache_zeros(*k_cache.shape, dtype, "cpu").copy_(k_cache)
        v_cache = kv_cache_zeros(*v_cache.shape, dtype, "cpu").copy_(v_cache)
    expected = paged_attention_reference(b.query, k_cache, v_cache, b.metadata, 0.25)
    got = paged_attention_invariant(b.query, k_cache, v_cache, b.metadata, 0.25)
    assert got.dtype == dtype and got.shape == b.query.shape
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)
    assert not got[-2:].any()  # padding rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiled_linear_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(dtype)
    tiled = RowTiledLinear(linear)
    x = torch.randn(3 * ROW_TILE + 5, 64).to(dtype)
    alone = tiled(x[:1])[0]
    for rows in range(2, len(x) + 1):
        assert torch.equal(tiled(x[:rows])[0], alone), rows
    torch.testing.assert_close(tiled(x), linear(x), atol=ATOL[dtype], rtol=0)


def step_of(metadata, rows: list[int], query_lens: list[int]):
    """The same cache and requests `rows` of the batch, each computing its last query_lens
    tokens: a decode step, a later prompt chunk or a prefix-cache hit's recomputed token."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = metadata.seq_lens_cpu[rows]
    return dataclasses.replace(
        metadata, num_actual_tokens=int(qsl[-1]), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens), block_table=metadata.block_table[rows],
        slot_mapping=metadata.slot_mapping[: qsl[-1]], max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        plan=None,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_tokens_attention_bits_do_not_depend_on_its_step(dtype):
    """Its prompt's tokens attended in one chunk, then the last ones again in other chunkings
    (mid query tile, across key tiles) beside other requests, or alone: the same bits."""
    long = 2 * KEY_TILE + QUERY_TILE + 3
    b = make_paged_batch([long, 50, 1], [long, 50, 90], 6, 2, head_dim=32, dtype=dtype)
    whole = paged_attention_invariant(b.query, b.k_cache, b.v_cache, b.metadata, 0.25)[:long]
    query = b.query[:long]
    for rows, lens in [([0], [1]), ([0], [QUERY_TILE + 5]), ([2, 0, 1], [1, KEY_TILE + 9, 50]),
                       ([1, 0], [3, 2])]:  # fmt: skip
        pairs = zip(rows, lens, strict=True)
        tokens = [query[long - n :] if r == 0 else b.query[:n] for r, n in pairs]
        metadata = step_of(b.metadata, rows, lens)
        got = paged_attention_invariant(torch.cat(tokens), b.k_cache, b.v_cache, metadata, 0.25)
        start = sum(lens[: rows.index(0)])
        ours = got[start : start + lens[rows.index(0)]]
        assert torch.equal(ours, whole[long - len(ours) :]), (rows, lens)
