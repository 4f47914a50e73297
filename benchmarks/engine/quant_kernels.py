"""Which matmul kernel is fastest for a quantized linear layer, per shape and number of rows.

Times worker_svc.quant.linear.QuantLinear's kernels at SmolLM2-135M's linear shapes: weight-only
int4 (group 32) and int8 (per row), bfloat16 packed for oneDNN, and fbgemm's dynamic int8 (int8
activations, VNNI). Each figure is the fastest of --calls single calls (the one no other
process interrupted, on a shared machine). worker_svc/quant/kernel_table.py holds
the table this printed on the machine its figures name.

    .venv/bin/python -m batchwire.benchmarks.engine.quant_kernels [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid

from worker_svc.quant.blocks import quantize_int4
from worker_svc.quant.linear import QuantLinear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
KERNELS = (("int4", "same"), ("int8", "same"), ("int4", "bf16"), ("int4", "dyn8"))


def best_us(layer: QuantLinear, x: torch.Tensor, calls: int) -> float:
    """The fastest of `calls` single calls: a call that another process interrupted (a 10 ms
    time slice on a loaded machine) is slower, never faster, so the fastest is the kernel's."""
    layer(x)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rows", default="1,4,16,32,64,128,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("shape rows " + " ".join(f"{s}/{large}" for s, large in KERNELS) + "  (us per call)")
    for name, (n, k) in SHAPES.items():
        weight = quantize_int4(torch.randn(n, k) * 0.05, "random")
        layers = [QuantLinear(weight, torch.bfloat16, small, large,
                              0 if large != "same" else 1 << 30) for small, large in KERNELS]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            times = [best_us(layer, x, args.calls) for layer in layers]
            print(f"{name} {rows} " + " ".join(f"{t:.0f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
