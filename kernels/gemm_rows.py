"""Row counts of CPU GEMMs, rounded up to a bounded set of buckets.

oneDNN, which runs torch's bfloat16 matmuls on CPU, builds a kernel for each shape it meets and
keeps it, about 1 MB a shape (in torch's ideep cache and in oneDNN's own, 1,024 shapes each). A
server whose steps hold every token count from 1 to a few thousand so grows for as long as new
counts come: 10% of its resident memory in a 10-minute soak of the default model, and 2.9 GB
over 1,600 row counts of one weight alone (benchmarks/engine/gemm_shapes.py). Padding the rows
to a bucket bounds the shapes each layer meets, at the cost of the padded rows' arithmetic: at
most 7 rows up to 128 rows (where reading the weight costs more than the rows), then at most a
quarter, mostly under a sixteenth. float32 matmuls (MKL) keep nothing per shape and need none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def padded_rows(rows: int) -> int:
    """The bucket of a GEMM of `rows` rows: a multiple of 8 up to 128, of 32 up to 1024, of
    128 beyond."""
    step = 8 if rows <= 128 else 32 if rows <= 1024 else 128
    return -(-rows // step) * step


def in_row_buckets(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
                   ) -> torch.Tensor:
    """gemm(x) for x [rows, ...], run on x's rows padded with zeros to padded_rows(rows) when x
    is bfloat16 on CPU; the padded rows' results are dropped (a view of the leading rows)."""
    rows = x.shape[0]
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or rows == 0:
        return gemm(x)
    bucket = padded_rows(rows)
    if bucket == rows:
        return gemm(x)
    return gemm(torch.cat([x, x.new_zeros(bucket - rows, *x.shape[1:])]))[:rows]
