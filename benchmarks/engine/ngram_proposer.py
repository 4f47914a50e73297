"""CPU cost of one n-gram proposal per request, the scheduler's per-step work under speculation.

Three kinds of sequence: random ids (W64-like: almost nothing matches), a text that repeats
itself (a 64-token block over and over: every suffix matches), and random ids over a small
alphabet (many short matches). Medians of repeated timings; one CPU thread.

    OMP_NUM_THREADS=1 .venv/bin/python -m batchwire.benchmarks.engine.ngram_proposer
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from batchwire.benchmarks.shared.help_format import DefaultsSaid

from scheduler_svc.core.ngram_proposer import propose_ngram_drafts


def sequences(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    block = rng.integers(100, 49_000, size=64)
    return {
        "random ids": rng.integers(100, 49_000, size=length).astype(np.int32),
        "repeating": np.resize(block, length).astype(np.int32),
        "16-token alphabet": rng.integers(0, 16, size=length).astype(np.int32),
    }


def time_us(tokens: np.ndarray, k: int, min_n: int, max_n: int, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        propose_ngram_drafts(tokens, k, min_n, max_n)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"k={args.k} n in [{args.min_n}, {args.max_n}]: us per request (median of "
        f"{args.repeats} x {args.calls} calls)"
    )
    for length in args.lengths:
        for name, tokens in sequences(length, rng).items():
            runs = [
                time_us(tokens, args.k, args.min_n, args.max_n, args.calls)
                for _ in range(args.repeats)
            ]
            print(f"  {length:5d} tokens, {name:18s} {statistics.median(runs):7.1f} us")


if __name__ == "__main__":
    main()
