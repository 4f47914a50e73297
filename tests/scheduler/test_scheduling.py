"""Scheduler.schedule(): token budget, chunked prefill, admission order, preemption."""

from __future__ import annotations

import pytest

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams

from .conftest import make_fake_engine, make_prompt, make_scheduler, run_step, scheduled_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def counts(so, requests) -> list[int]:
    sched = scheduled_tokens(so)
    return [sched.get(r.wire_id, 0) for r in requests]


def test_requests_keep_arrival_order():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8)
    reqs = [s.add_request(make_prompt(10, 1000 * i), GREEDY) for i in range(5)]
    so, _ = run_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == [r.wire_id for r in reqs[:5]]
    assert counts(so, reqs) == [10, 10, 10, 10, 10]
    so, _ = run_step(s)
    # Running requests come first, in admission order, as deltas only.
    assert list(so.scheduled_cached_reqs.req_ids) == [r.wire_id for r in reqs]
    assert len(so.scheduled_new_reqs) == 0


def test_chunked_prefill_long_prompts_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    reqs = [s.add_request(make_prompt(800, 1000 * i), GREEDY) for i in range(3)]
    so1, out1 = run_step(s)
    assert counts(so1, reqs) == [400, 400, 224]
    assert out1 == []  # all three are mid-prefill: no token yet
    so2, out2 = run_step(s)
    assert counts(so2, reqs) == [400, 400, 224]
    assert list(so2.scheduled_cached_reqs.num_computed_tokens) == [400, 400, 224]
    assert [o.request_id for o in out2] == [reqs[0].request_id, reqs[1].request_id]
    so3, _ = run_step(s)
    assert counts(so3, reqs) == [1, 1, 352]
    assert so3.total_num_scheduled_tokens == 354
    # The third request was sent in full once, with its whole block table.
    assert len(so1.scheduled_new_reqs[2].block_ids) == 224 // 16
    assert [len(b.ids) for b in so2.scheduled_cached_reqs.new_block_ids] == [25, 25, 14]


def test_without_chunked_prefill_a_long_prompt_blocks_those_behind_it():
    s = make_scheduler(max_num_batched_tokens=512, max_model_len=512,
                       enable_chunked_prefill=False)
    a, b, c = (s.add_request(make_prompt(n, 1000 * i), GREEDY)
               for i, n in enumerate((300, 300, 10)))
    so, _ = run_step(s)
    # b does not fit in the 212 tokens left and may not be cut; c fits but must not overtake b.
    assert counts(so, [a, b, c]) == [300, 0, 0]
    assert b.status == c.status == RequestStatus.WAITING
    so, _ = run_step(s)
    assert counts(so, [a, b, c]) == [1, 300, 10]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [s.add_request(make_prompt(5, 100 * i), GREEDY) for i in range(3)]
    so, _ = run_step(s)
    assert counts(so, reqs) == [5, 5, 0]


def test_fcfs_preempts_the_most_recently_admitted_and_admits_nothing_that_step():
    # 5 usable blocks of 4 tokens; a and b fill 2 blocks each.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=20,
                       max_num_batched_tokens=64)
    a = s.add_request(make_prompt(8, 100), GREEDY)
    b = s.add_request(make_prompt(8, 200), GREEDY)
    run_step(s)
    c = s.add_request(make_prompt(2, 300), GREEDY)  # would fit in b's freed blocks
    so, _ = run_step(s)
    # a takes the last free block for its 9th token; b finds none and is preempted.
    assert counts(so, [a, b, c]) == [1, 0, 0]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert c.status == RequestStatus.WAITING
    assert list(s.waiting) == [b, c]  # the victim goes back to the front
    s.kv.check_invariants()


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_preemption_victim_by_policy(policy, victim):
    """b (priority 5) is admitted first; a (0) and c (1) join; then a needs a block and none is
    free. FCFS preempts the last admitted (c); priority preempts the lowest priority (b), undoing
    b's share of this step although b was already scheduled."""
    s = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=4, max_model_len=24,
                       max_num_batched_tokens=64, policy=policy)
    reqs = {"b": s.add_request(make_prompt(5, 100), GREEDY, priority=5)}
    run_step(s)
    reqs["a"] = s.add_request(make_prompt(8, 200), GREEDY, priority=0)
    reqs["c"] = s.add_request(make_prompt(7, 300), GREEDY, priority=1)
    run_step(s)
    assert s.kv.num_free_blocks == 0
    so, _ = run_step(s)
    sched = scheduled_tokens(so)
    assert reqs[victim].status == RequestStatus.PREEMPTED
    assert reqs[victim].wire_id not in sched
    assert sorted(sched) == sorted(r.wire_id for k, r in reqs.items() if k != victim)
    assert so.total_num_scheduled_tokens == sum(sched.values())
    s.kv.check_invariants()


def test_resumed_request_gets_its_whole_block_table():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=20,
                       max_num_batched_tokens=64, enable_prefix_caching=False)
    a = s.add_request(make_prompt(8, 100), SamplingParams(temperature=0, max_tokens=2))
    b = s.add_request(make_prompt(8, 200), GREEDY)
    run_step(s)
    run_step(s)  # b is preempted
    assert b.status == RequestStatus.PREEMPTED
    while b.status != RequestStatus.RUNNING:
        so, _ = run_step(s)
    assert a.is_finished
    cached = so.scheduled_cached_reqs
    assert list(cached.resumed_req_ids) == [b.wire_id]
    i = list(cached.req_ids).index(b.wire_id)
    assert list(cached.new_block_ids[i].ids) == s.kv.block_ids(b.wire_id)
    assert cached.num_computed_tokens[i] == 0 and cached.num_scheduled_tokens[i] == 9


def test_preempted_request_completes_with_the_same_tokens():
    prompts = [make_prompt(n, 7 * i) for i, n in enumerate((9, 14, 6, 11))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(num_blocks):
        engine, _ = make_fake_engine(num_blocks, 4, max_model_len=32, max_num_batched_tokens=32)
        reqs = [engine.add_request(p, params) for p in prompts]
        tokens = {r.request_id: [] for r in reqs}
        while engine.has_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        engine.scheduler.kv.check_invariants()
        return [tokens[r.request_id] for r in reqs], sum(r.num_preemptions for r in reqs)

    tight, num_preemptions = run(num_blocks=9)
    roomy, none = run(num_blocks=64)
    assert num_preemptions > 0 and none == 0
    assert tight == roomy
