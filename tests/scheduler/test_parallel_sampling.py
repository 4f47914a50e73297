"""n sequences of one prompt: the prompt's blocks are allocated once and shared, seeds differ."""

from __future__ import annotations

import pytest

from scheduler_svc import InvalidRequestError, SamplingParams
from scheduler_svc.core.parallel_sampling import child_params, child_seed

from .conftest import make_prompt, make_scheduler, run_step, scheduled_tokens


def test_children_share_the_prompts_full_blocks_allocated_once():
    s = make_scheduler(num_blocks=128, block_size=16)
    prompt = make_prompt(40)  # 2 full blocks and a tail of 8 tokens
    params = SamplingParams(temperature=0, max_tokens=4, n=4)
    children = [s.add_request(prompt, child_params(params, i)) for i in range(4)]
    free_before = s.kv.num_free_blocks
    so, _ = run_step(s)
    counts = scheduled_tokens(so)
    # The first child prefills the whole prompt; the others only the tail after its 2 blocks.
    assert [counts[c.wire_id] for c in children] == [40, 8, 8, 8]
    tables = [s.kv.block_ids(c.wire_id) for c in children]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4  # each sequence has its own tail block
    assert free_before - s.kv.num_free_blocks == 2 + 4  # not 4 * 3
    shared = s.kv.req_to_blocks[children[0].wire_id][:2]
    assert [b.ref_cnt for b in shared] == [4, 4]
    s.abort_requests(children[:3])
    assert [b.ref_cnt for b in shared] == [1, 1]  # held until the last sequence ends
    s.abort_requests(children[3:])
    assert [b.ref_cnt for b in shared] == [0, 0]
    s.kv.check_invariants()


def test_child_seeds_are_reproducible_distinct_and_keep_the_seed_for_index_0():
    seeds = [child_seed(1234, i) for i in range(8)]
    assert seeds[0] == 1234 and len(set(seeds)) == 8
    assert seeds == [child_seed(1234, i) for i in range(8)]
    assert all(0 <= x < 2**64 for x in seeds)
    params = SamplingParams(seed=5, n=3)
    assert [child_params(params, i).seed for i in range(3)] == [child_seed(5, i) for i in range(3)]
    assert child_params(params, 2).n == 1
    assert child_params(SamplingParams(n=3), 1).seed is None


def test_scheduler_refuses_a_request_of_several_sequences():
    with pytest.raises(InvalidRequestError) as e:
        make_scheduler().add_request(make_prompt(4), SamplingParams(n=2))
    assert e.value.field == "n"
