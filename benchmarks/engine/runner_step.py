"""CPU cost of the runner's input side per steady decode step: persistent batch vs rebuild.

Times _update_states + _prepare_inputs (no forward pass) with N running requests, each step one
decode token per request, in the same run for both variants.

    .venv/bin/python -m batchwire.benchmarks.engine.runner_step --num-reqs 256 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import transformers
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.common.worker_config import WorkerConfig
from batchwire.v1 import worker_pb2 as pb

from worker_svc.batch.validation import CheckedStep
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.worker import Worker


class RebuildingModelRunner(ModelRunner):
    """The naive alternative: empty the batch and re-add every scheduled request each step."""

    def _update_states(self, so: pb.SchedulerOutput, checked: CheckedStep | None = None) -> None:
        super()._update_states(so, checked)
        batch = self.input_batch
        states = [s for s in batch.states[: batch.num_reqs] if s is not None]
        for state in states:
            batch.remove_request(state.req_id)
        batch.condense()
        for state in states:
            batch.add_request(state)


def tiny_worker(num_reqs: int, prompt_len: int, steps: int) -> Worker:
    folder = tempfile.mkdtemp()
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    max_len = prompt_len + steps + 16
    blocks_per_req = -(-max_len // 16)
    return Worker(WorkerConfig(
        model=folder, dtype="float32", max_num_reqs=num_reqs, max_model_len=max_len,
        max_num_batched_tokens=max(num_reqs, prompt_len),
        kv_cache_memory_bytes=(num_reqs * blocks_per_req + 2) * 2 * 16 * 2 * 16 * 4,
    ))  # fmt: skip


def decode_steps(num_reqs: int, prompt_len: int, steps: int, block_size: int = 16):
    """One prefill-free start (all prompt tokens computed) then `steps` decode steps."""
    blocks_per_req = -(-(prompt_len + steps + 1) // block_size)
    ids = [format(i, "x") for i in range(num_reqs)]
    first = pb.SchedulerOutput(total_num_scheduled_tokens=num_reqs)
    next_block = 1
    tables = {}
    for r in ids:
        tables[r] = list(range(next_block, next_block + blocks_per_req))
        next_block += blocks_per_req
        first.scheduled_new_reqs.add(
            req_id=r, prompt_token_ids=[7] * prompt_len, block_ids=tables[r][: prompt_len // block_size + 1],  # noqa: E501
            num_computed_tokens=prompt_len - 1, num_scheduled_tokens=1,
            sampling=pb.RequestSamplingParams(top_p=1.0, repetition_penalty=1.0),
        )  # fmt: skip
    yield first
    for s in range(steps):
        so = pb.SchedulerOutput(total_num_scheduled_tokens=num_reqs)
        c = so.scheduled_cached_reqs
        pos = prompt_len + s
        for r in ids:
            c.req_ids.append(r)
            blocks = c.new_block_ids.add()
            if pos % block_size == 0:  # the request crosses into a new block
                blocks.ids.append(tables[r][pos // block_size])
            c.num_computed_tokens.append(pos)
            c.num_scheduled_tokens.append(1)
        yield so


def time_runner(runner: ModelRunner, steps: list[pb.SchedulerOutput]) -> list[float]:
    times = []
    for so in steps:
        t0 = time.perf_counter()
        runner._update_states(so)
        runner._prepare_inputs(so)
        times.append(time.perf_counter() - t0)
        # Stand-in for sampling: every request gets its token, as after a real step.
        batch = runner.input_batch
        for row in range(batch.num_reqs):
            state = batch.states[row]
            assert state is not None  # rows below num_reqs are occupied
            state.output_token_ids.append(9)
            batch.append_token(row, 9)
    return times[1:]  # the first step adds every request in both variants


def measure(num_reqs: int, prompt_len: int, steps: int, repeats: int = 1
            ) -> dict[str, list[float]]:
    """Median microseconds per decode step of each variant, one figure per repeat; the same
    steps for both, the variants taking turns."""
    worker = tiny_worker(num_reqs, prompt_len, steps)
    outputs = list(decode_steps(num_reqs, prompt_len, steps))
    medians: dict[str, list[float]] = {"persistent": [], "rebuild": []}
    for _ in range(repeats):
        for name, cls in [("persistent", ModelRunner), ("rebuild", RebuildingModelRunner)]:
            runner = cls(worker.config, worker.model, worker.num_blocks)
            medians[name].append(statistics.median(time_runner(runner, outputs)) * 1e6)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = {name: us[0] for name, us in measure(args.num_reqs, args.prompt_len,
                                                   args.steps).items()}
    print(
        f"{args.num_reqs} running requests, median over {args.steps} decode steps "
        "(_update_states + _prepare_inputs):"
    )
    for name, us in results.items():
        print(f"  {name:>10}: {us:8.1f} us/step")
    print(f"  rebuild / persistent = {results['rebuild'] / results['persistent']:.1f}x")


if __name__ == "__main__":
    main()
