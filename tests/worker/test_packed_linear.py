"""Pre-packed bfloat16 linears give the same numbers as F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_svc.models.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.bfloat16, "cpu"),
    reason="oneDNN's packed bf16 linear needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which this "
           "CPU lacks; test_a_bfloat16_worker_loads_and_steps_on_any_cpu covers the plain path",
)


@pytest.mark.parametrize("batch", [1, 7, 64, 300])
def test_packed_equals_plain(batch):
    torch.manual_seed(0)
    plain = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(batch, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(plain)(x), plain(x), rtol=0, atol=0)


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    model = model.to(torch.bfloat16)
    pack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)
