"""Random workloads on a tiny block pool: every request finishes exactly once, no block leaks, and
every greedy output equals the output of that request run alone."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_svc.core.sampling_params import SamplingParams

from .conftest import make_fake_engine

VOCAB = 16  # small, so that prompts share blocks and the prefix cache is exercised
EOS = 1
MAX_STEPS = 3000  # far above any workload here: reaching it means a livelock


@dataclasses.dataclass
class Arrival:
    step: int
    prompt: list[int]
    params: SamplingParams
    priority: int
    abort_step: int | None


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.integers(8, 24))
    num_blocks = -(-max_model_len // block_size) + 1 + draw(st.integers(0, 4))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(max_num_seqs, 32))
    config = dict(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.integers(0, 8)),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    shared = draw(st.lists(st.integers(2, VOCAB - 1), min_size=8, max_size=8))
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        head = shared[: draw(st.integers(0, 8))]
        tail = draw(st.lists(st.integers(2, VOCAB - 1), max_size=max_model_len))
        prompt = (head + tail)[: max_model_len - 1] or [2]
        params = SamplingParams(temperature=0, max_tokens=draw(st.integers(1, 12)),
                                ignore_eos=draw(st.booleans()))
        step = draw(st.integers(0, 6))
        abort = draw(st.none() | st.integers(step, step + 10))
        arrivals.append(Arrival(step, prompt, params, draw(st.integers(0, 3)), abort))
    return num_blocks, block_size, config, arrivals


def run(num_blocks, block_size, config, arrivals, main_run=False):
    """Runs the workload; returns per arrival (tokens, finish reason, finished count)."""
    engine, worker = make_fake_engine(num_blocks, block_size, VOCAB, (EOS,), **config)
    tokens = {i: [] for i in range(len(arrivals))}
    reasons: dict[int, list[str]] = {i: [] for i in range(len(arrivals))}
    step = 0
    while step <= max(a.step for a in arrivals) or engine.has_requests():
        for i, a in enumerate(arrivals):
            if a.step == step:
                engine.add_request(a.prompt, a.params, request_id=str(i), priority=a.priority)
        outputs = engine.abort_requests([str(i) for i, a in enumerate(arrivals)
                                         if a.abort_step == step])
        outputs += engine.step()
        for out in outputs:
            tokens[int(out.request_id)] += out.new_token_ids
            if out.finished:
                reasons[int(out.request_id)].append(out.finish_reason)
        if main_run:
            engine.scheduler.kv.check_invariants()
        step += 1
        assert step < MAX_STEPS, "the engine stopped making progress"
    # Reported by --hypothesis-show-statistics: the workloads must reach these paths.
    seen = worker.seen_outputs
    if main_run:
        event(f"preempted: {any(len(so.scheduled_cached_reqs.resumed_req_ids) for so in seen)}")
        hit = any(r.num_computed_tokens for so in seen for r in so.scheduled_new_reqs)
        event(f"prefix hit: {hit}")
    kv = engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks - 1, "blocks leaked"
    assert not worker.requests, f"the worker was never told {sorted(worker.requests)} finished"
    return tokens, reasons


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_finishes_once_with_its_solo_output(workload):
    num_blocks, block_size, config, arrivals = workload
    tokens, reasons = run(num_blocks, block_size, config, arrivals, main_run=True)
    roomy = -(-config["max_model_len"] // block_size) * len(arrivals) + 1
    for i, a in enumerate(arrivals):
        assert len(reasons[i]) == 1, f"request {i} finished {len(reasons[i])} times"
        solo_tokens, solo_reasons = run(roomy, block_size, config,
                                        [dataclasses.replace(a, step=0, abort_step=None)])
        if reasons[i] == ["abort"]:
            assert solo_tokens[0][: len(tokens[i])] == tokens[i]
        else:
            assert (tokens[i], reasons[i]) == (solo_tokens[0], solo_reasons[0]), f"request {i}"
