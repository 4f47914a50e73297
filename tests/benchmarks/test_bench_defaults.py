"""Each `batchwire bench` sub-command's defaults are its own and are what its --help says: one
benchmark's default (overhead's float32) once leaked into every other through a shared parser."""

from __future__ import annotations

import re

import pytest
from batchwire.benchmarks.__main__ import BENCHMARKS, build_parser

# float32 where bfloat16 would measure the CPU's bf16 matmuls instead of what the benchmark is
# about (overhead: the engine's own time; chaos: request integrity under failures).
DTYPES = {name: "bfloat16" for name in [*BENCHMARKS, "all"]} | {"overhead": "float32",
                                                                 "chaos": "float32"}


def sub_parser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "benchmark")
    return parser, sub.choices[name]


@pytest.mark.parametrize("name", [*BENCHMARKS, "all"])
def test_each_benchmarks_defaults_are_its_own_and_its_help_says_them(name):
    parser, sub = sub_parser(name)
    args = parser.parse_args([name])
    assert args.dtype == DTYPES[name]
    help_text = " ".join(sub.format_help().split())
    assert re.search(rf"--dtype \{{bfloat16,float32\}}.*?\(default: {args.dtype}\)", help_text)
