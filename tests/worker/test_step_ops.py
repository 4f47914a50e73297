"""The model's fused torch-path ops (worker_svc/models/step_ops.py) give the kernels' torch path
outputs exactly, in float32 and in bfloat16: the greedy parity tests rest on it."""

from __future__ import annotations

import pytest
import torch
from batchwire.kernels.rms_norm import rms_norm_torch
from batchwire.kernels.rotary_embedding import rotary_embedding_torch

from worker_svc.models.rotary import cos_sin_cache
from worker_svc.models.step_ops import StepTables, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rotating_q_and_k_together_equals_the_kernel(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    nq, nkv, hd = 9, 3, 64
    qkv = torch.randn(num_tokens, (nq + 2 * nkv) * hd, generator=gen).to(dtype)
    positions = torch.randint(0, 2000, (num_tokens,), generator=gen)
    table = cos_sin_cache(hd, 2048, 10000.0, None)
    want_q, want_k = (qkv[:, :nq * hd].reshape(num_tokens, nq, hd).clone(),
                      qkv[:, nq * hd:(nq + nkv) * hd].reshape(num_tokens, nkv, hd).clone())
    rotary_embedding_torch(positions, want_q, want_k, table)
    step = StepTables.build(positions, table, hd)
    assert step.fused
    v_before = qkv[:, (nq + nkv) * hd:].clone()
    step.rotate(qkv[:, :(nq + nkv) * hd].view(num_tokens, nq + nkv, hd))
    assert torch.equal(qkv[:, :nq * hd].view(num_tokens, nq, hd), want_q)
    assert torch.equal(qkv[:, nq * hd:(nq + nkv) * hd].view(num_tokens, nkv, hd), want_k)
    assert torch.equal(qkv[:, (nq + nkv) * hd:], v_before)  # v untouched


def test_a_partial_rotary_dim_keeps_the_kernel():
    table = cos_sin_cache(32, 64, 10000.0, None)  # rotary_dim 32 of head_dim 64
    assert not StepTables.build(torch.arange(3), table, 64).fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_kernel(dtype, with_residual):
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(5, 576, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = (torch.rand(576, generator=gen) * 2).to(dtype)
    res = residual if with_residual else None
    got, want = rms_norm(x, weight, 1e-5, res), rms_norm_torch(x, weight, 1e-5, res)
    if with_residual:
        assert isinstance(got, tuple) and isinstance(want, tuple)
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("padding", [0, 2])
def test_write_kv_equals_reshape_and_cache_on_every_layer(padding):
    from batchwire import kernels
    from batchwire.kernels.kv_cache import kv_cache_zeros

    gen = torch.Generator().manual_seed(padding)
    slot_mapping = torch.tensor([5, 17, 40] + [-1] * padding)
    step = StepTables.build(torch.arange(3 + padding), cos_sin_cache(8, 64, 10000.0, None), 8)
    for layer in range(2):  # the second layer reuses the rows the first one found
        key, value = (torch.randn(3 + padding, 2, 8, generator=gen) for _ in range(2))
        got_k, got_v, want_k, want_v = (kv_cache_zeros(4, 16, 2, 8, torch.float32, "cpu")
                                        for _ in range(4))
        step.write_kv(key, value, got_k, got_v, slot_mapping)
        kernels.reshape_and_cache(key, value, want_k, want_v, slot_mapping)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), layer
    assert (step.rows is None) == (padding == 0)
