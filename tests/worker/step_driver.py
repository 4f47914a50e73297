"""A minimal scheduler for worker tests: builds real SchedulerOutput messages step after step.

It hands out KV blocks from a free list, chunks prefills, and can pause, preempt and resume
requests, so tests can drive the runner through every path of the persistent-batch diff. Given a
`propose` callback it also sends draft tokens for decoding requests (speculative decoding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchwire.v1 import worker_pb2 as pb


def greedy() -> pb.RequestSamplingParams:
    return pb.RequestSamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


@dataclasses.dataclass
class DriverRequest:
    req_id: str
    prompt: list[int]
    max_tokens: int
    sampling: pb.RequestSamplingParams
    output: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    sent: bool = False  # the worker has seen it in full
    paused: bool = False  # held by the worker but not scheduled
    resumed: bool = False  # preempted: its next step replaces its block table
    drafts: list[int] = dataclasses.field(default_factory=list)  # sent this step
    lora: pb.LoRAAdapterRef | None = None  # the adapter it runs with; None = the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class StepDriver:
    def __init__(self, runner, num_blocks: int, block_size: int, chunk: int = 10**9) -> None:
        self.runner = runner  # anything with execute_model(so) and sample_tokens(g)
        self.block_size = block_size
        self.chunk = chunk  # most prompt tokens one request computes per step
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        self.active: dict[str, DriverRequest] = {}
        self.finished_since_last_step: list[str] = []
        self.results: dict[str, list[int]] = {}
        # Draft tokens for a decoding request (capped so no step overshoots max_tokens).
        self.propose: Callable[[DriverRequest], list[int]] | None = None
        self.num_drafted = 0
        self.num_accepted = 0

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, sampling=None, lora=None
    ) -> None:
        self.active[req_id] = DriverRequest(
            req_id, list(prompt), max_tokens, sampling or greedy(), lora=lora
        )

    def preempt(self, req_id: str) -> None:
        req = self.active[req_id]
        self.free_blocks.extend(reversed(req.blocks))
        req.blocks, req.computed, req.resumed = [], 0, True

    def build_step(self) -> pb.SchedulerOutput:
        so = pb.SchedulerOutput(finished_req_ids=self.finished_since_last_step)
        self.finished_since_last_step = []
        cached = so.scheduled_cached_reqs
        for req in self.active.values():
            if req.paused:
                continue
            req.drafts = []
            if self.propose and req.sent and not req.resumed and req.computed == req.num_tokens - 1:
                req.drafts = list(self.propose(req))[: req.max_tokens - len(req.output) - 1]
            n = min(self.chunk, req.num_tokens - req.computed) + len(req.drafts)
            needed = -(-(req.computed + n) // self.block_size) - len(req.blocks)
            new_blocks = [self.free_blocks.pop(0) for _ in range(needed)]
            req.blocks += new_blocks
            if not req.sent:
                so.scheduled_new_reqs.add(
                    req_id=req.req_id, prompt_token_ids=req.prompt, output_token_ids=req.output,
                    sampling=req.sampling,
                    block_ids=req.blocks, num_computed_tokens=req.computed, num_scheduled_tokens=n,
                    lora=req.lora,
                )  # fmt: skip
                req.sent = True
            else:
                cached.req_ids.append(req.req_id)
                if req.resumed:
                    cached.resumed_req_ids.append(req.req_id)
                    new_blocks, req.resumed = req.blocks, False
                cached.new_block_ids.add().ids.extend(new_blocks)
                cached.num_computed_tokens.append(req.computed)
                cached.num_scheduled_tokens.append(n)
                if req.drafts:
                    so.scheduled_spec_decode_tokens.add(req_id=req.req_id, ids=req.drafts)
            so.total_num_scheduled_tokens += n
        return so

    def apply_output(self, so: pb.SchedulerOutput, out: pb.ModelRunnerOutput) -> None:
        scheduled = {r.req_id: r.num_scheduled_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        scheduled.update(zip(cached.req_ids, cached.num_scheduled_tokens, strict=True))
        for req_id, n in scheduled.items():
            self.active[req_id].computed += n
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            req = self.active[req_id]
            if req.drafts:  # the rejected drafts' KV is not kept
                req.computed -= len(req.drafts) + 1 - len(tokens.ids)
                self.num_drafted += len(req.drafts)
                self.num_accepted += len(tokens.ids) - 1
            req.output.extend(tokens.ids)
            if req.done:
                self.results[req_id] = req.output
                self.free_blocks.extend(reversed(req.blocks))
                del self.active[req_id]
                self.finished_since_last_step.append(req_id)

    def step(self) -> pb.ModelRunnerOutput:
        so = self.build_step()
        out = self.runner.execute_model(so)
        if out is None:
            out = self.runner.sample_tokens(None)
        self.apply_output(so, out)
        return out

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.active:
                return self.results
            self.step()
        raise AssertionError(f"requests still active after {max_steps} steps: {list(self.active)}")
