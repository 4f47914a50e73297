"""Each `batchwire bench` sub-command's defaults are its own and are what its --help says: one
benchmark's default (overhead's float32) once leaked into every other through a shared parser.
Every benchmark's parser, the front's and each module's own, says each option's default."""

from __future__ import annotations

import argparse
import ast
import re

import pytest
from batchwire.benchmarks.__main__ import BENCHMARKS, build_parser
from batchwire.benchmarks.serving.one_stream import cases
from batchwire.benchmarks.shared.help_format import DefaultsSaid

from tests.test_layers import ROOT

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


@pytest.mark.parametrize("name", [*BENCHMARKS, "all"])
def test_each_option_with_a_default_says_it_in_the_help(name):
    _, sub = sub_parser(name)
    formatter = sub._get_formatter()
    unsaid = [a.option_strings[-1] for a in sub._actions
              if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
              and "default" not in formatter._expand_help(a)]
    assert not unsaid, f"{name}: {unsaid} do not say their default"


def test_latency_defaults_are_what_its_help_says():
    """One stream: a 512-token prompt's TTFT, TPOT at 128 and 1024 output tokens after a
    128-token prompt, batchwire alone unless --llama-server names the peer's binary."""
    parser, sub = sub_parser("latency")
    args = parser.parse_args(["latency"])
    assert args.llama_server is None and args.repeats == 3
    assert cases(args) == {"ttft 512": (512, 2), "out 128": (128, 128), "out 1024": (128, 1024)}
    help_text = " ".join(sub.format_help().split())
    for option, default in (("--input-len", "128"), ("--long-input-len", "512"),
                            ("--output-lens", "128,1024"), ("--llama-server", "none")):
        assert re.search(rf"{option} \S+ .*?\(default: {default}", help_text), option


def test_throughput_measures_the_engines_own_weights_and_decode_step_by_default():
    """W64 with the quantized default and the native decode step, as `serve` runs; lists of
    either measure each beside the other in one run, and name the cases so."""
    from batchwire.benchmarks.shared.cases import cpu_decode_cases, mode_setting, quantization_cases

    parser, sub = sub_parser("throughput")
    args = parser.parse_args(["throughput"])
    assert (args.quantization, args.cpu_decode) == ("auto", "native")
    help_text = " ".join(sub.format_help().split())
    for option, default in (("--quantization", "auto"), ("--cpu-decode", "native")):
        assert re.search(rf"{option} \S+ .*?default: {default}\)", help_text), option
    cases_ = cpu_decode_cases(quantization_cases(["uni"], "auto,none"), "native,torch")
    assert cases_ == ["uni", "uni quant=none", "uni decode=torch", "uni quant=none decode=torch"]
    assert mode_setting("uni quant=none decode=torch") == {"quantization": "none",
                                                           "cpu_decode": "torch"}


def test_defaults_said_ends_each_options_help_with_its_default_unless_it_says_it():
    parser = argparse.ArgumentParser(prog="bench", formatter_class=DefaultsSaid)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", default="1,2", help="rows per step")
    parser.add_argument("--model", help="a checkpoint (default: the embedded one)")
    parser.add_argument("--peer", help="a binary")
    parser.add_argument("--quick", action="store_true", help="a small run")
    text = " ".join(parser.format_help().split())
    assert "--steps STEPS (default: 4)" in text
    assert "--rows ROWS rows per step (default: 1,2)" in text
    assert "a checkpoint (default: the embedded one) --peer" in text
    assert "--peer PEER a binary --quick a small run" in text


def test_every_benchmark_parser_says_its_defaults():
    """Each ArgumentParser and sub-parser made under benchmarks/ is given DefaultsSaid."""
    unsaid = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("ArgumentParser", "add_parser")):
                continue
            given = {k.arg: k.value for k in node.keywords}
            formatter = given.get("formatter_class")
            if node.func.attr == "ArgumentParser" and isinstance(node.func.value, ast.Name) and (
                    node.func.value.id == "argparse") and path.name == "__main__.py":
                continue  # the front's own list of sub-commands keeps its raw description
            if not (isinstance(formatter, ast.Name) and formatter.id == "DefaultsSaid"):
                unsaid.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not unsaid, unsaid
