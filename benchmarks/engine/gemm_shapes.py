"""Resident memory after bfloat16 GEMMs of many row counts, plain and in row buckets.

A layer of the default model (gate|up, [3072 x 576], bfloat16, packed for oneDNN as the worker
packs it) is run once at each row count from 1 to --rows, each way in a fresh process of its
own: plainly, as every step's token count reaches it, and with the rows padded to
kernels/gemm_rows.py's buckets. oneDNN keeps a kernel per shape it meets, so the plain way's
memory grows with the row counts; the buckets bound it. Also float32 (MKL), which keeps
nothing per shape, for reference.

    .venv/bin/python -m batchwire.benchmarks.engine.gemm_shapes --rows 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from batchwire.benchmarks.shared.help_format import DefaultsSaid

WAYS = ("bfloat16 plain", "bfloat16 in buckets", "float32 plain")


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one_way(way: str, rows: int, threads: int) -> dict[str, float]:
    """In this process: RSS before and after the layer at every row count up to `rows`."""
    import torch
    from batchwire.kernels.gemm_rows import in_row_buckets

    torch.set_num_threads(threads)
    dtype = torch.float32 if way.startswith("float32") else torch.bfloat16
    weight = torch.randn(3072, 576).to(dtype)
    if dtype == torch.bfloat16:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

        def layer(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    else:
        def layer(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, weight)

    layer(torch.randn(1, 576).to(dtype))
    before = rss_mib()
    for count in range(1, rows + 1):
        x = torch.randn(count, 576).to(dtype)
        if "buckets" in way:
            in_row_buckets(layer, x)
        else:
            layer(x)
    return {"before_mib": before, "after_mib": rss_mib()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--rows", type=int, default=1000, help="row counts 1..ROWS, each once")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child's one way
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.way:
        print(json.dumps(one_way(args.way, args.rows, args.threads)))
        return
    print(f"gate|up [3072 x 576], row counts 1..{args.rows}, each way in a fresh process")
    print(f"  {'way':<22} {'RSS before':>11} {'after':>9} {'growth':>9}")
    for way in WAYS:
        done = subprocess.run([sys.executable, "-m", __spec__.name, "--way", way, "--rows",
                               str(args.rows), "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        growth = got["after_mib"] - got["before_mib"]
        print(f"  {way:<22} {got['before_mib']:>7.0f} MiB {got['after_mib']:>5.0f} MiB "
              f"{growth:>+5.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
