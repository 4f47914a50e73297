"""Each Triton launcher against its torch reference, on small odd shapes."""

import math

import numpy as np
import pytest
import torch
from batchwire.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from batchwire.kernels.reshape_and_cache import reshape_and_cache_torch, reshape_and_cache_triton
from batchwire.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from batchwire.kernels.rotary_embedding import rotary_embedding_torch, rotary_embedding_triton
from batchwire.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton
from kernel_factories import ATOL, make_paged_batch

# (query_lens, seq_lens): decode rows of lengths 1, 17, 33 and block boundaries, a fresh prompt,
# chunked prefills over a cached prefix, and a mix of all of them in one launch.
BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 17, 33, 32]),
    "prefill": ([17], [17]),
    "chunked": ([16, 5], [48, 38]),
    "mixed": ([5, 1, 33, 1], [37, 16, 33, 1]),
}
# (num_q_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1, 3, 8; head dims 64, 80, 128.
CONFIGS = [
    (4, 4, 64, 16, torch.float32),
    (6, 2, 80, 32, torch.bfloat16),
    (8, 1, 128, 16, torch.float16),
    (3, 1, 64, 32, torch.float32),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-b{c[3]}")
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_paged_attention(batch, config):
    num_q, num_kv, head_dim, block_size, dtype = config
    b = make_paged_batch(
        *BATCHES[batch], num_q, num_kv, head_dim, block_size, dtype, num_padding_tokens=1
    )
    scale = 1 / math.sqrt(head_dim)
    got = paged_attention_triton(b.query, b.k_cache, b.v_cache, b.metadata, scale)
    want = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.metadata, scale)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("num_kv_splits", [2, 8])
@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}")
def test_paged_attention_split_kv_decode(config, num_kv_splits):
    num_q, num_kv, head_dim, block_size, dtype = config
    # Contexts shorter than the split count leave some splits empty.
    b = make_paged_batch([1, 1, 1], [200, 3, 65], num_q, num_kv, head_dim, block_size, dtype)
    got = paged_attention_triton(b.query, b.k_cache, b.v_cache, b.metadata, 0.1, num_kv_splits)
    want = paged_attention_reference(b.query, b.k_cache, b.v_cache, b.metadata, 0.1)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


def test_paged_attention_rejects_mismatched_cache():
    b = make_paged_batch([1], [5], 4, 2, head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(b.query[..., :8], b.k_cache, b.v_cache, b.metadata, 1.0)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        paged_attention_triton(b.query, b.k_cache.half(), b.v_cache, b.metadata, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_reshape_and_cache(dtype, num_kv_heads):
    b = make_paged_batch(
        [3, 1, 17], [20, 7, 33], 3, num_kv_heads, 80, 16, dtype, num_padding_tokens=2
    )
    got_k, got_v = torch.zeros_like(b.k_cache), torch.zeros_like(b.v_cache)
    want_k, want_v = got_k.clone(), got_v.clone()
    reshape_and_cache_triton(b.key, b.value, got_k, got_v, b.metadata.slot_mapping)
    reshape_and_cache_torch(b.key, b.value, want_k, want_v, b.metadata.slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (17, 96), (3, 576), (5, 3, 80)])
def test_rms_norm(shape, with_residual, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.rand(shape[-1], generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    # The interpreter truncates when narrowing to bfloat16; the GPU rounds: 1 ulp apart.
    torch.testing.assert_close(
        rms_norm_triton(x, weight, 1e-5, residual), rms_norm_torch(x, weight, 1e-5, residual)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 80), (64, 32)])
def test_rotary_embedding(heads, head_dim, rotary_dim, dtype):
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 16, 5, 32, 33])
    cos_sin = torch.randn(40, rotary_dim, generator=gen)
    q = torch.randn(5, heads[0], head_dim, generator=gen).to(dtype)
    k = torch.randn(5, heads[1], head_dim, generator=gen).to(dtype)
    got = rotary_embedding_triton(positions, q.clone(), k.clone(), cos_sin)
    want = rotary_embedding_torch(positions, q.clone(), k.clone(), cos_sin)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("vocab", [1, 33, 2049])
@pytest.mark.parametrize("with_rows", [False, True])
def test_apply_token_bitmask(vocab, with_rows):
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(2, words)).astype(np.int32))
    logits = torch.randn(3, vocab)
    rows = torch.tensor([2, 0]) if with_rows else None
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask_triton(got, bitmask, rows)
    apply_token_bitmask_torch(want, bitmask, rows)
    assert torch.equal(got, want)
