"""Scheduler CPU time per steady decode step: N running requests, M more waiting behind them.

Times schedule() (including building the protobuf SchedulerOutput) and update_from_output() on a
fake worker answer of one token per request; the answer is built outside the timed region. With
--tokenizer the default model's tokenizer detokenizes every token, as a server streaming text does.

    .venv/bin/python -m batchwire.benchmarks.engine.scheduler_step --running 256 --waiting 1000 \
        --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import time

from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.v1 import worker_pb2 as pb

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler


def answer(so: pb.SchedulerOutput, token: int) -> pb.ModelRunnerOutput:
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    sampled = [pb.TokenIds(ids=[token])] * len(ids)
    return pb.ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def measure(running: int, waiting: int, prompt_len: int, steps: int, block_size: int = 16,
            prefix_caching: bool = True, tokenizer=None):
    """(schedule() us, update_from_output() us, SchedulerOutput bytes), one of each per step."""
    max_model_len = prompt_len + steps + 64
    blocks_per_req = -(-max_model_len // block_size)
    config = SchedulerConfig(
        max_num_seqs=running, max_model_len=max_model_len,
        max_num_batched_tokens=max(running * prompt_len, running),
        enable_prefix_caching=prefix_caching,
        max_queued_requests=running + waiting,
    )  # fmt: skip
    scheduler = Scheduler(config, num_blocks=running * blocks_per_req + 1,
                          block_size=block_size, vocab_size=49152, eos_token_ids=[2],
                          tokenizer=tokenizer)
    # As many tokens as fit: no request stops during the measured steps.
    params = SamplingParams(temperature=0, max_tokens=max_model_len - prompt_len, ignore_eos=True)
    for i in range(running + waiting):
        # Distinct prompts: no prefix hit makes the admission side cheaper than it is in general.
        prompt = [(1000 + 7919 * i + j) % 49000 + 100 for j in range(prompt_len)]
        scheduler.add_request(prompt, params)

    so = scheduler.schedule()  # admits `running` requests, prefilling all of them at once
    scheduler.update_from_output(so, answer(so, 100))
    assert len(scheduler.running) == running and len(scheduler.waiting) == waiting

    sched_us, update_us, sizes = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        out = answer(so, 100 + step % 500)
        t2 = time.perf_counter()
        scheduler.update_from_output(so, out)
        t3 = time.perf_counter()
        sched_us.append((t1 - t0) * 1e6)
        update_us.append((t3 - t2) * 1e6)
        sizes.append(so.ByteSize())
    assert len(so.scheduled_cached_reqs.req_ids) == running and not so.scheduled_new_reqs
    return sched_us, update_us, sizes


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--tokenizer", action="store_true", help="give the scheduler the default "
                    "model's tokenizer (text is made after the step, not by the scheduler)")
    args = ap.parse_args()

    tokenizer = None
    if args.tokenizer:
        from scheduler_svc.core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(None)
    sched_us, update_us, sizes = measure(
        args.running, args.waiting, args.prompt_len, args.steps, args.block_size,
        not args.no_prefix_caching, tokenizer)

    total = [a + b for a, b in zip(sched_us, update_us, strict=True)]
    print(f"{args.running} running, {args.waiting} waiting, {args.steps} decode steps, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"tokenizer {'on' if tokenizer else 'off'}")
    print(f"  schedule()            median {statistics.median(sched_us):8.1f} us")
    print(f"  update_from_output()  median {statistics.median(update_us):8.1f} us")
    print(f"  step total            median {statistics.median(total):8.1f} us"
          f"   (p90 {statistics.quantiles(total, n=10)[-1]:.1f} us)")
    print(f"  SchedulerOutput       median {statistics.median(sizes):8.0f} bytes")


if __name__ == "__main__":
    main()
