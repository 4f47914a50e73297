"""Linear layers whose every row is computed by the same fixed-shape matmul, whatever M is.

A CPU GEMM picks its kernel, blocking and reduction order from the shape: on this machine's
torch a float32 row comes out with other bits at M = 1, at M = 2..3 and at M >= 4
(`benchmarks/engine/row_invariance.py`), so a request's hidden states depended on how many
other tokens shared its step. Here the rows are padded up to a multiple of ROW_TILE and
multiplied as a batch of [ROW_TILE, K] x [K, N] tiles (one bmm): each tile is the same call
shape, and a row's bits depend neither on its position inside a tile (measured: none of 16
positions differ) nor on the number of tiles (measured: none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.models.packed_linear import PackedLinear

ROW_TILE = 16  # rows per matmul tile; a decode step of fewer rows pays for 16


class RowTiledLinear(nn.Module):
    """y = x W^T + b over fixed [ROW_TILE, in_features] tiles. Keeps `weight` and `bias`
    (tied embeddings and tensor-parallel code read them)."""

    def __init__(self, linear: nn.Linear | PackedLinear) -> None:
        super().__init__()
        self.weight: torch.Tensor = linear.weight
        self.bias: torch.Tensor | None = linear.bias
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]  # x: (M, in_features)
        num_tiles = -(-rows // ROW_TILE)
        tiles = F.pad(x, (0, 0, 0, num_tiles * ROW_TILE - rows))  # (tiles * T, in)
        tiles = tiles.view(num_tiles, ROW_TILE, self.in_features)  # (tiles, T, in)
        # The weight's transpose, broadcast to every tile without a copy: (tiles, in, out).
        weight = self.weight.t().expand(num_tiles, self.in_features, self.out_features)
        y = torch.bmm(tiles, weight).view(-1, self.out_features)[:rows]  # (M, out)
        return y if self.bias is None else y + self.bias


def tile_linears(model: nn.Module) -> None:
    """Replaces every linear layer inside model (plain or pre-packed) by a RowTiledLinear."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear | PackedLinear):
            setattr(model, name, RowTiledLinear(child))
        else:
            tile_linears(child)
