"""kernels/gemm_rows.py: a bfloat16 GEMM on CPU meets a bounded set of row counts (oneDNN keeps a
kernel per shape, about 1-3 MB each), with the same results on the real rows; the worker's
linear layers run their GEMMs through it."""

from __future__ import annotations

import torch
from batchwire.kernels import gemm_rows
from batchwire.kernels.gemm_rows import in_row_buckets, padded_rows

from worker_svc.models import packed_linear
from worker_svc.quant import linear as quant_linear
from worker_svc.quant.blocks import quantize_int4
from worker_svc.quant.linear import QuantLinear


def test_every_row_count_has_a_bucket_at_most_a_little_larger():
    buckets = [padded_rows(rows) for rows in range(1, 4097)]
    assert buckets[:9] == [8] * 8 + [16]
    assert (padded_rows(128), padded_rows(129), padded_rows(1024), padded_rows(1025)) == (
        128, 160, 1024, 1152)
    for rows, bucket in enumerate(buckets, start=1):
        assert rows <= bucket <= max(rows + 7, rows * 5 // 4)
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 16 + 28 + 24


def test_a_bfloat16_gemm_sees_only_buckets_and_gives_the_real_rows_their_results():
    torch.manual_seed(0)
    weight = torch.randn(40, 24).bfloat16()
    seen: set[int] = set()

    def gemm(x: torch.Tensor) -> torch.Tensor:
        seen.add(x.shape[0])
        return torch.nn.functional.linear(x, weight)

    for rows in range(1, 300):
        x = torch.randn(rows, 24).bfloat16()
        y = in_row_buckets(gemm, x)
        assert y.shape == (rows, 40) and y.is_contiguous()
        torch.testing.assert_close(y.float(), x.float() @ weight.float().T, rtol=2e-2, atol=5e-2)
    assert seen == {padded_rows(rows) for rows in range(1, 300)}
    seen.clear()
    in_row_buckets(gemm, torch.randn(13, 24).bfloat16()[:0])  # no rows: nothing padded
    assert seen == {0}


def test_float32_gemms_keep_their_rows():
    seen: list[int] = []
    in_row_buckets(lambda x: seen.append(x.shape[0]) or x, torch.randn(13, 4))
    assert seen == [13]


def test_the_worker_linears_run_their_bfloat16_gemms_in_buckets(monkeypatch):
    calls: list[int] = []

    def recording(gemm, x):
        calls.append(x.shape[0])
        return gemm_rows.in_row_buckets(gemm, x)

    monkeypatch.setattr(quant_linear, "in_row_buckets", recording)
    monkeypatch.setattr(packed_linear, "in_row_buckets", recording)
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 32).bfloat16()
    x = torch.randn(2, 5, 64).bfloat16()  # 10 rows, past the weight-only kernels' few
    if packed_linear.packing_available(torch.bfloat16, "cpu"):
        out = packed_linear.PackedLinear(plain)(x)
        torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
        assert calls == [10]
    calls.clear()
    large = "bf16" if packed_linear.packing_available(torch.bfloat16, "cpu") else "dense"
    layer = QuantLinear(quantize_int4(plain.weight.float(), "test"), torch.bfloat16, "int4",
                        large, small_rows=4)
    assert layer(x).shape == (2, 5, 32) and calls == [10]
