"""One stream's decode time per output token (TPOT), quantized weights against de-quantised, in
one process and one run, taking turns.

Each round runs one greedy request of --output-len tokens (EOS ignored) and the same request cut
to 1 token on each engine; TPOT = (t(N) - t(1)) / (N - 1), the prefill and the engine's start of
a request cancelling out. Reports the median over --rounds per --quantization mode, and the
ratio to the first mode.

    .venv/bin/python -m batchwire.benchmarks.offline.quant_decode --quantization auto,none
    .venv/bin/python -m batchwire.benchmarks.offline.quant_decode --quantization auto \
        --cpu-decode native,torch
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from batchwire.benchmarks.shared.help_format import DefaultsSaid

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    from scheduler_svc.core.sampling_params import SamplingParams
    from scheduler_svc.engine.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--quantization", default="auto,none")
    parser.add_argument("--cpu-decode", default="native",
                        help="comma list; with one --quantization, the engines are the decode "
                        "paths (native,torch)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [(q, c) for q in args.quantization.split(",") for c in args.cpu_decode.split(",")]
    modes = [f"{q}/{c}" for q, c in pairs]
    engines = {f"{q}/{c}": LLM(dtype=args.dtype, quantization=q, cpu_decode=c,
                               enable_prefix_caching=False, max_num_seqs=4) for q, c in pairs}
    long = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tpot: dict[str, list[float]] = {m: [] for m in modes}
    for llm in engines.values():
        llm.generate([PROMPT], long, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate([PROMPT], short, use_tqdm=False)
            one = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([PROMPT], long, use_tqdm=False)
            tpot[mode].append((time.perf_counter() - start - one) / (args.output_len - 1))
    first = statistics.median(tpot[modes[0]])
    for mode in modes:
        median = statistics.median(tpot[mode])
        print(f"quantization/cpu-decode {mode}: TPOT {median * 1e3:.1f} ms "
              f"({1 / median:.1f} tok/s); {modes[0]} is {median / first:.2f}x as fast "
              f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in tpot[mode])} ms)")


if __name__ == "__main__":
    main()
