"""Which kernel a quantized linear layer runs, by shape and rows: a fixed table, measured.

`benchmarks/engine/quant_kernels.py` times the candidates (weight-only int4 / int8, bfloat16
packed for oneDNN, fbgemm dynamic int8) at SmolLM2-135M's shapes; the table keeps, per shape,
the row count up to which the weight-only kernel was faster, and the faster large-batch kernel.
A fixed table rather than a calibration at load: timings taken at load on a shared CPU are
noisy, would slow every start, and would let two workers of one deployment compute with
different kernels (different rounding) for the same batch.

Measured on the 2-core AMD EPYC (avx512_bf16, avx512_vnni, no AMX) of docs/performance.md,
torch 2.13, 2 threads, a shared machine (load average 7-9), the fastest of 40 single calls, us:
  rows            1        4         8        16       64      (int4 / int8 / bf16 packed)
  o 576x576       18/16/28  34/33/33  52/59/47  71/75/52  256/275/122
  down 576x1536   36/35/42  56/57/74  109/115/65 204/204/123 792/763/290
  gate_up 3072x576 67/71/71 104/131/81 193/217/98 366/390/155 1455/-/634
The weight-only kernels win at one row (a single stream's decode; the issue's quiet-machine
figures: int8 weight-only 104 GFLOP/s against bfloat16's 37 at M=1), up to 4 rows where the
weight is at least as wide as it is tall (o, down); bfloat16 packed wins from 8 rows on at every
shape. fbgemm's dynamic int8 was faster still at 64 rows on some shapes but is not used: its
activations are quantized per tensor to 7 bits, and on SmolLM2 that cut the teacher-forced top-1
agreement with the float32 reference from 0.97 to 0.45 (mean KL 1.1 nats; docs/performance.md).
"""

from __future__ import annotations

# The large-batch kernel: "bf16" (oneDNN, bfloat16 weight packed once); "dyn8" (fbgemm's
# dynamic int8) is measured by the benchmark but refused on quality (above).
LARGE_KERNEL = "bf16"


def choose(out_features: int, in_features: int) -> tuple[int, str]:
    """(rows served by the weight-only kernel, the kernel beyond) for an [out, in] weight."""
    return (4 if out_features <= in_features else 1), LARGE_KERNEL
