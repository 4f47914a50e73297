"""A model of the scheduler's side of the worker protocol, for the stateful fuzz tests: it knows
which requests the worker holds, with which blocks and counts, and draws valid next steps.

A step is planned first (`plan_step`) and committed only once the worker accepted it
(`commit`, then `record` with the sampled tokens), so a hostile variant of the same plan can be
sent and refused in between without the model moving.
"""

from __future__ import annotations

import dataclasses

from batchwire.v1 import worker_pb2 as pb
from hypothesis import strategies as st

ID_PREFIX = "req-"  # the model's ids; garbage messages use none that start with it
MAX_REQUEST_TOKENS = 80  # a request this long is finished: keeps every step cheap
MAX_NEW_PER_STEP = 3


@dataclasses.dataclass
class ModelRequest:
    req_id: str
    prompt: list[int]
    outputs: list[int]
    sampling: pb.RequestSamplingParams
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    preempted: bool = False  # held by the worker without blocks; its next step resumes it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


@dataclasses.dataclass
class StepPlan:
    """One valid step and what it changes once accepted."""

    so: pb.SchedulerOutput
    grammar: pb.GrammarOutput
    new: list[ModelRequest]
    finished: list[str]
    preempted: list[str]
    scheduled: dict[str, int]  # req_id -> tokens scheduled this step
    new_blocks: dict[str, list[int]]  # appended (resumed: the whole table)
    resumed: list[str]
    drafts: dict[str, int]  # req_id -> number of draft tokens


def sampling_params(vocab_size: int) -> st.SearchStrategy[pb.RequestSamplingParams]:
    """Valid, deterministic sampling: greedy, or a temperature with a seed of its own."""

    @st.composite
    def build(draw) -> pb.RequestSamplingParams:
        token = st.integers(0, vocab_size - 1)
        s = pb.RequestSamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
        if draw(st.booleans()):
            s.temperature = draw(st.floats(0.3, 2.0))
            s.seed = draw(st.integers(0, 2**64 - 1))
            s.top_p = draw(st.sampled_from([1.0, 0.9, 0.5, 1e-6]))
            s.top_k = draw(st.sampled_from([0, -1, 1, 5, 50, vocab_size + 7]))
            s.min_p = draw(st.sampled_from([0.0, 0.1, 1.0]))
        if draw(st.booleans()):
            s.repetition_penalty = draw(st.floats(0.5, 2.0))
            s.presence_penalty = draw(st.floats(-2.0, 2.0))
            s.frequency_penalty = draw(st.floats(-2.0, 2.0))
        if draw(st.booleans()):
            s.min_tokens = draw(st.integers(0, 4))
            s.stop_token_ids.extend(draw(st.lists(token, max_size=3)))
        if draw(st.booleans()):
            s.logprobs = draw(st.integers(0, 20))
        if draw(st.integers(0, 3)) == 0:
            s.prompt_logprobs = draw(st.integers(0, 5))
        if draw(st.booleans()):
            for t, bias in draw(st.dictionaries(token, st.floats(-100, 100), max_size=4)).items():
                s.logit_bias[t] = bias
            s.allowed_token_ids.extend(draw(st.lists(token, max_size=6)))
            for word in draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=2)):
                s.bad_words.add(ids=word)
        return s

    return build()


class SchedulerModel:
    def __init__(self, info: pb.WorkerInfo) -> None:
        self.vocab_size = info.vocab_size
        self.block_size = info.block_size
        self.max_num_reqs = info.max_num_reqs
        self.max_model_len = info.max_model_len
        self.budget = 512  # max_num_batched_tokens of the fuzzed worker
        # The lower half of the pool; garbage messages may take blocks from the upper half
        # without overwriting the KV of the model's requests.
        self.free_blocks = list(range(1, info.num_blocks // 2))
        self.garbage_blocks = (info.num_blocks // 2, info.num_blocks)
        self.requests: dict[str, ModelRequest] = {}
        self.ever_added: set[str] = set()
        self.next_id = 0
        self.step_id = 0

    def blocks_needed(self, req: ModelRequest, tokens: int) -> int:
        held = 0 if req.preempted else len(req.blocks)
        return max(0, -(-tokens // self.block_size) - held)

    def plan_step(self, draw) -> StepPlan:
        self.step_id += 1
        so = pb.SchedulerOutput(step_id=self.step_id)
        free = list(self.free_blocks)
        held = list(self.requests.values())
        finished = [r.req_id for r in held
                    if r.num_tokens >= MAX_REQUEST_TOKENS or draw(st.integers(0, 9)) == 0]
        alive = [r for r in held if r.req_id not in finished]
        preempt = [r.req_id for r in alive if not r.preempted and draw(st.integers(0, 9)) == 0]
        for r in held:  # freed blocks are reused this very step, as the scheduler does
            if r.req_id in finished or r.req_id in preempt:
                free.extend(r.blocks)
        plan = StepPlan(so, pb.GrammarOutput(), [], finished, preempt, {}, {}, [], {})
        so.finished_req_ids.extend(finished)
        cached = so.scheduled_cached_reqs
        total = 0
        for r in alive:
            if r.req_id in preempt or draw(st.integers(0, 5)) == 0:
                continue  # not scheduled this step: it leaves the batch, the worker keeps it
            computed = 0 if r.preempted else r.computed
            remaining = r.num_tokens - computed
            n = draw(st.integers(1, remaining)) if remaining > 1 else 1
            drafts: list[int] = []
            if (remaining == 1 and not r.preempted and draw(st.integers(0, 3)) == 0
                    and r.num_tokens + 3 < self.max_model_len):
                drafts = draw(st.lists(st.integers(0, self.vocab_size - 1), min_size=1,
                                       max_size=3))
            n += len(drafts)
            need = self.blocks_needed(r, computed + n)
            if total + n > self.budget or len(plan.scheduled) >= self.max_num_reqs \
                    or need > len(free):
                continue
            blocks = [free.pop(0) for _ in range(need)]
            cached.req_ids.append(r.req_id)
            cached.new_block_ids.add(ids=blocks)
            cached.num_computed_tokens.append(computed)
            cached.num_scheduled_tokens.append(n)
            if r.preempted:
                cached.resumed_req_ids.append(r.req_id)
                plan.resumed.append(r.req_id)
            if drafts:
                so.scheduled_spec_decode_tokens.add(req_id=r.req_id, ids=drafts)
                plan.drafts[r.req_id] = len(drafts)
            plan.scheduled[r.req_id] = n
            plan.new_blocks[r.req_id] = blocks
            total += n
        alive_count = len(alive)
        for _ in range(draw(st.integers(0, MAX_NEW_PER_STEP))):
            if len(plan.scheduled) >= self.max_num_reqs or alive_count >= 2 * self.max_num_reqs:
                break
            req = ModelRequest(
                f"{ID_PREFIX}{self.next_id}",
                draw(st.lists(st.integers(0, self.vocab_size - 1), min_size=1, max_size=40)),
                draw(st.lists(st.integers(0, self.vocab_size - 1), max_size=3)),
                draw(sampling_params(self.vocab_size)),
            )
            n = draw(st.integers(1, req.num_tokens))
            need = self.blocks_needed(req, n)
            if total + n > self.budget or need > len(free):
                break
            self.next_id += 1
            req.blocks = [free.pop(0) for _ in range(need)]
            so.scheduled_new_reqs.add(
                req_id=req.req_id, prompt_token_ids=req.prompt, output_token_ids=req.outputs,
                sampling=req.sampling, block_ids=req.blocks, num_scheduled_tokens=n)
            plan.new.append(req)
            plan.scheduled[req.req_id] = n
            total += n
            alive_count += 1
        so.total_num_scheduled_tokens = total
        plan.grammar = self._grammar(draw, plan)
        return plan

    def _grammar(self, draw, plan: StepPlan) -> pb.GrammarOutput:
        """Valid rows for some undrafted requests: any bytes, with a token allowed in each."""
        grammar = pb.GrammarOutput()
        words = -(-self.vocab_size // 32)
        rows = []
        for req_id in plan.scheduled:
            if req_id in plan.drafts or draw(st.integers(0, 3)):
                continue
            row = bytearray(draw(st.binary(min_size=4 * words, max_size=4 * words)))
            row[4 * draw(st.integers(0, self.vocab_size // 32 - 1))] |= 1  # one token allowed
            grammar.req_ids.append(req_id)
            rows.append(bytes(row))
        grammar.bitmask = b"".join(rows)
        return grammar

    def commit(self, plan: StepPlan) -> None:
        """The worker accepted the plan's ExecuteModel."""
        for req_id in plan.finished:
            self.free_blocks.extend(self.requests.pop(req_id).blocks)
        for req_id in plan.preempted:
            r = self.requests[req_id]
            self.free_blocks.extend(r.blocks)
            r.blocks, r.computed, r.preempted = [], 0, True
        taken = {b for blocks in plan.new_blocks.values() for b in blocks}
        taken.update(b for r in plan.new for b in r.blocks)
        self.free_blocks = [b for b in self.free_blocks if b not in taken]
        for req_id, blocks in plan.new_blocks.items():
            r = self.requests[req_id]
            r.blocks = r.blocks + blocks if not r.preempted else list(blocks)
            r.preempted = False
        for r in plan.new:
            self.requests[r.req_id] = r
            self.ever_added.add(r.req_id)

    def record(self, plan: StepPlan, sampled: dict[str, list[int]]) -> None:
        """The sampled tokens of a committed plan (empty for a request still mid-prefill)."""
        for req_id, n in plan.scheduled.items():
            r = self.requests[req_id]
            tokens = sampled.get(req_id, [])
            drafts = plan.drafts.get(req_id, 0)
            # Rejected drafts are taken back: they were computed but are not the request's.
            r.computed += n - (1 + drafts - len(tokens) if tokens else 0)
            r.outputs.extend(tokens)
