"""benchmarks/offline/rounding_budget.py: its defaults are what its help says, and `rounded`
rounds exactly the part it names and puts every weight back."""

from __future__ import annotations

import torch
from batchwire.benchmarks.offline.rounding_budget import TEXT, build_parser, rounded
from torch import nn


def test_the_defaults_are_what_the_help_says():
    parser = build_parser()
    args = parser.parse_args([])
    assert (args.text, args.windows, args.threads) == (TEXT, 3, 2)
    text = " ".join(parser.format_help().split())
    assert f"(default: {TEXT})" in text and "(default: 3)" in text and "(default: 2)" in text


def test_rounded_touches_only_the_part_it_names_and_restores_the_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # the last one plays the LM head
    linears = list(model)
    x = torch.randn(3, 8)
    weights = [m.weight.detach().clone() for m in linears]
    plain = model(x)

    def is_bfloat16(t: torch.Tensor) -> bool:
        return torch.equal(t, t.to(torch.bfloat16).float())

    with torch.no_grad():
        with rounded(linears, "weights"):
            assert all(is_bfloat16(m.weight) for m in linears)
        with rounded(linears, "head output"):
            assert is_bfloat16(model(x)) and not torch.equal(model(x), plain)
        with rounded(linears, "layer outputs"):
            hidden = linears[0](x)
            assert is_bfloat16(hidden) and not is_bfloat16(linears[1](hidden))
        first, head = linears
        expected = head(first(x.bfloat16().float()).bfloat16().float())
        with rounded(linears, "inputs"):
            assert torch.equal(model(x), expected) and not torch.equal(expected, plain)
        assert torch.equal(model(x), plain)
    assert all(torch.equal(m.weight, w) for m, w in zip(linears, weights, strict=True))
