"""The torch paths (what CPU workers run) against simple references written another way."""

import math
import sys

import numpy as np
import pytest
import torch
from batchwire import kernels
from batchwire.kernels.kv_cache import kv_cache_zeros
from batchwire.kernels.paged_attention import paged_attention_reference
from batchwire.kernels.paged_attention_cpu import build_plan, paged_attention_torch
from kernel_factories import ATOL, make_paged_batch

# (query_lens, seq_lens): decode only, prefill only, chunked prefill with prefixes, mixed,
# lengths 1, 17, 33 and exact block boundaries (16, 32, 48).
ATTENTION_BATCHES = [
    ([1], [1]),
    ([1, 1, 1], [17, 33, 16]),
    ([17], [17]),
    ([16, 33], [48, 33]),
    ([5, 1, 17, 1], [37, 32, 50, 1]),
    ([1, 3, 1, 33], [64, 3, 15, 40]),
    ([1] * 6, [200, 1, 70, 16, 129, 33]),  # lengths far apart: several decode groups
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", ATTENTION_BATCHES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_torch_matches_reference(dtype, lens, heads, block_size):
    query_lens, seq_lens = lens
    b = make_paged_batch(
        query_lens, seq_lens, *heads, head_dim=32, block_size=block_size, dtype=dtype,
        num_padding_tokens=2,
    )
    scale = 1 / math.sqrt(32)
    expected = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.metadata, scale)
    got = paged_attention_torch(b.query, b.k_cache, b.v_cache, b.metadata, scale)
    assert got.dtype == dtype and got.shape == b.query.shape
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)
    # The plan built by the first layer serves the next one, on another layer's cache.
    plan = b.metadata.plan
    got2 = paged_attention_torch(b.query, b.v_cache, b.k_cache, b.metadata, scale)
    assert b.metadata.plan is plan
    expected2 = paged_attention_reference(b.query, b.v_cache, b.k_cache, b.metadata, scale)
    torch.testing.assert_close(got2, expected2, atol=ATOL[dtype], rtol=0)


def test_decode_rows_are_grouped_by_length():
    b = make_paged_batch([1] * 6, [200, 1, 70, 16, 129, 33], 4, 2, head_dim=8)
    plan = build_plan(b.metadata, block_size=16)
    # Blocks needed: 13, 1, 5, 1, 9, 3 -> {13, 9}, {5, 3}, {1, 1}: padding at most doubles.
    assert [g.num_rows for g in plan.decode_groups] == [2, 2, 2]
    assert sum(g.blocks.numel() for g in plan.decode_groups) == 2 * 13 + 2 * 5 + 2 * 1


def test_paged_attention_decode_rows_out_of_order():
    # Decode rows scattered between prefill rows take the index (not slice) path.
    b = make_paged_batch([1, 4, 1, 2, 1], [9, 20, 1, 18, 40], 6, 2, head_dim=16)
    expected = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.metadata, 0.25)
    got = kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.25)
    torch.testing.assert_close(got, expected, atol=ATOL[torch.float32], rtol=0)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache in kv_cache_zeros' CPU storage."""
    out = kv_cache_zeros(*cache.shape, cache.dtype, "cpu")
    assert out.permute(2, 0, 1, 3).is_contiguous()
    return out.copy_(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", ATTENTION_BATCHES)
def test_paged_attention_torch_on_the_cpu_cache_layout(dtype, lens):
    b = make_paged_batch(*lens, 6, 2, head_dim=32, dtype=dtype, num_padding_tokens=2)
    expected = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.metadata, 0.25)
    got = paged_attention_torch(
        b.query, head_major(b.k_cache), head_major(b.v_cache), b.metadata, 0.25
    )
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)


def test_reshape_and_cache_on_the_cpu_cache_layout():
    b = make_paged_batch([3, 1], [20, 7], 4, 2, head_dim=8)
    k_cache, v_cache = head_major(torch.zeros_like(b.k_cache)), head_major(b.v_cache.zero_())
    kernels.reshape_and_cache(b.key, b.value, k_cache, v_cache, b.metadata.slot_mapping)
    plain_k, plain_v = torch.zeros_like(b.k_cache), torch.zeros_like(b.v_cache)
    kernels.reshape_and_cache(b.key, b.value, plain_k, plain_v, b.metadata.slot_mapping)
    assert torch.equal(k_cache, plain_k) and torch.equal(v_cache, plain_v)


@pytest.mark.parametrize("padding", [0, 3])
def test_reshape_and_cache_writes_slots_and_skips_padding(padding):
    b = make_paged_batch([3, 1], [20, 7], 4, 2, head_dim=8, num_padding_tokens=padding)
    k_cache, v_cache = torch.zeros_like(b.k_cache), torch.zeros_like(b.v_cache)
    kernels.reshape_and_cache(b.key, b.value, k_cache, v_cache, b.metadata.slot_mapping)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(b.metadata.slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // 16, slot % 16] = b.key[t]
            expected_v[slot // 16, slot % 16] = b.value[t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=gen).to(dtype)
    residual = torch.randn(5, 24, generator=gen).to(dtype)
    weight = torch.rand(24, generator=gen).to(dtype)

    def norm(h):
        h = h.double()
        return (h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight.double()).to(dtype)

    out = kernels.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, norm(x))
    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual=residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_rotary_embedding_rotates_pairs_by_position_angle(rotary_dim):
    gen = torch.Generator().manual_seed(0)
    head_dim, half = 16, rotary_dim // 2
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(40, dtype=torch.float64), inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], -1).float()  # [40, rotary_dim]
    positions = torch.tensor([0, 7, 39, 3])
    q, k = torch.randn(4, 3, head_dim, generator=gen), torch.randn(4, 1, head_dim, generator=gen)

    def expected(x):
        # Neox pairs feature i with i + half; rotating the pair is multiplying by e^{i angle}.
        z = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double())
        z = z * torch.polar(torch.ones_like(angles), angles)[positions][:, None, :]
        return torch.cat([z.real, z.imag, x[..., rotary_dim:].double()], -1).float()

    want_q, want_k = expected(q), expected(k)
    got_q, got_k = kernels.rotary_embedding(positions, q.clone(), k.clone(), cache)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


@pytest.mark.parametrize("vocab", [31, 32, 100])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("byteorder", ["little", "big"])  # the byte table, or shifts of words
def test_apply_token_bitmask(vocab, with_rows, byteorder, monkeypatch):
    monkeypatch.setattr(sys, "byteorder", byteorder)
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    allowed = rng.random((2, words * 32)) < 0.5  # [k, words * 32]
    packed = (allowed.reshape(2, words, 32) * (1 << np.arange(32, dtype=np.int64))).sum(-1)
    bitmask = torch.from_numpy(packed.astype(np.uint32).view(np.int32))  # [k, words]
    logits = torch.randn(4, vocab)
    rows = [3, 1] if with_rows else [0, 1]
    expected = logits.clone()
    for i, row in enumerate(rows):
        expected[row, ~torch.from_numpy(allowed[i, :vocab])] = float("-inf")
    kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows) if with_rows else None)
    assert torch.equal(logits, expected)



def test_apply_token_bitmask_with_no_rows_changes_nothing():
    logits = torch.randn(2, 40)
    before = logits.clone()
    kernels.apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [1, 16, 17, 70, 129])
def test_one_decode_row_on_consecutive_blocks_reads_the_cache_in_place(dtype, seq_len):
    """A lone stream's blocks are consecutive ids: its keys are a view of the head-major cache.
    Same output as the reference and as the gather path it replaces."""
    b = make_paged_batch([1], [seq_len], 9, 3, head_dim=64, dtype=dtype, spare_blocks=4)
    n = -(-seq_len // 16)
    b.metadata.block_table[0, :n] = torch.arange(2, 2 + n, dtype=torch.int32)
    k_cache, v_cache = head_major(b.k_cache), head_major(b.v_cache)
    expected = paged_attention_reference(b.query, k_cache, v_cache, b.metadata, 0.125)
    got = paged_attention_torch(b.query, k_cache, v_cache, b.metadata, 0.125)
    assert b.metadata.plan.decode_groups[0].run == (2, seq_len)
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)
    b.metadata.plan.decode_groups[0].run = None  # the gather path, on the same plan
    gathered = paged_attention_torch(b.query, k_cache, v_cache, b.metadata, 0.125)
    torch.testing.assert_close(got, gathered, atol=ATOL[dtype], rtol=0)


def test_blocks_out_of_order_take_the_gather_path():
    b = make_paged_batch([1], [40], 6, 2, head_dim=16)
    b.metadata.block_table[0, :3] = torch.tensor([4, 2, 3], dtype=torch.int32)
    assert build_plan(b.metadata, block_size=16).decode_groups[0].run is None
