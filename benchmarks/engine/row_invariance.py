"""Does one row's result depend on the rest of the batch? Measured op by op on this machine's torch.

For each op a step runs over a [M, ...] batch (the model's linears at SmolLM2's shapes, the
attention matmuls, RMSNorm's reduction, the logprobs' log_softmax) it computes row 0 alone and
inside batches of M = 2..64 random rows, and counts the M whose row 0 is not bit-identical. It
also checks what `worker_svc/batch_invariant/` relies on: a row inside a fixed [T, K] tile gives
the same bits at every position of the tile, and a batched matmul (bmm) of fixed-shape tiles
gives each tile the same bits whatever the number of tiles.

    .venv/bin/python -m batchwire.benchmarks.engine.row_invariance [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from batchwire.benchmarks.shared.help_format import DefaultsSaid

TILE = 16  # worker_svc.batch_invariant.linear.ROW_TILE
LINEARS = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
           "lm_head": (576, 49152)}


def varying_batch_sizes(
    op: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor
) -> list[int]:
    """The batch sizes M in 2..len(rows) at which op(rows[:M])[0] differs from op(rows[:1])[0]."""
    alone = op(rows[:1])[0]
    return [m for m in range(2, len(rows) + 1) if not torch.equal(op(rows[:m])[0], alone)]


def tile_positions_varying(weight: torch.Tensor, row: torch.Tensor) -> int:
    """How many positions p of a [TILE, K] tile give row a result other than position 0's."""
    outs = []
    for p in range(TILE):
        tile = torch.randn(TILE, row.shape[0]).to(row.dtype)
        tile[p] = row
        outs.append(F.linear(tile, weight)[p])
    return sum(not torch.equal(o, outs[0]) for o in outs[1:])


def bmm_counts_varying(weight: torch.Tensor, rows: torch.Tensor) -> list[int]:
    """Tile counts n at which tile 0 of bmm([n, TILE, K], weight) differs from n = 1."""
    k, n_out = weight.shape[1], weight.shape[0]

    def tiled(n: int) -> torch.Tensor:
        return torch.bmm(rows[: n * TILE].view(n, TILE, k), weight.t().expand(n, k, n_out))[0]

    alone = tiled(1)
    return [n for n in (2, 3, 4) if not torch.equal(tiled(n), alone)]


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def measure(dtype: torch.dtype) -> list[str]:
    torch.manual_seed(0)
    lines = []
    for name, (k, n) in LINEARS.items():
        weight = (torch.randn(n, k) * 0.05).to(dtype)
        rows = torch.randn(64, k).to(dtype)
        varying = varying_batch_sizes(functools.partial(F.linear, weight=weight), rows)
        lines.append(
            f"{dtype}  linear {name:8} [M,{k}]x[{k},{n}]: row 0 differs at {len(varying)}/63 "
            f"batch sizes {varying[:6]}{'...' if len(varying) > 6 else ''}; in a fixed "
            f"[{TILE},{k}] tile at {tile_positions_varying(weight, rows[0])}/{TILE - 1} other "
            f"positions; bmm of tiles at tile counts {bmm_counts_varying(weight, rows)}"
        )
    q, keys = torch.randn(64, 3, 64).to(dtype), torch.randn(64, 64, 128).to(dtype)
    bmm = varying_batch_sizes(lambda x: torch.bmm(x, keys[: len(x)]), q)
    lines.append(f"{dtype}  attention bmm [n,3,64]x[n,64,128]: item 0 differs at {bmm}")
    hidden = torch.randn(64, 576).to(dtype)
    lines.append(f"{dtype}  rms_norm [M,576]: row 0 differs at "
                 f"{varying_batch_sizes(rms_norm, hidden)}")
    logits = torch.randn(64, 49152)
    lines.append(f"float32  log_softmax [M,49152]: row 0 differs at "
                 f"{varying_batch_sizes(lambda x: x.log_softmax(-1), logits)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for dtype in (torch.float32, torch.bfloat16):
        for line in measure(dtype):
            print(line)


if __name__ == "__main__":
    main()
