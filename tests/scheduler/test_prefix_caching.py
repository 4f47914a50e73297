"""The block pool and prefix caching: hits, reference counts, free order, LRU eviction."""

from __future__ import annotations

import pytest

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams

from .conftest import make_prompt, make_scheduler, run_step

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make_request(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, PARAMS, cache_salt=salt)


def allocate(kv: KVCacheManager, request: Request) -> list[int]:
    """Admits a request the way the scheduler does; returns its block ids."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens
    return kv.block_ids(request.wire_id)


def test_shared_48_token_prefix_hits_three_blocks_with_refcount_two():
    s = make_scheduler(block_size=16)
    prefix = make_prompt(48, 500)
    a = s.add_request(prefix + make_prompt(10, 100), PARAMS)
    run_step(s)
    b = s.add_request(prefix + make_prompt(5, 200), PARAMS)
    so, _ = run_step(s)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == b.wire_id
    assert new.num_computed_tokens == 48 and new.num_scheduled_tokens == 5
    a_blocks = s.kv.req_to_blocks[a.wire_id]
    b_blocks = s.kv.req_to_blocks[b.wire_id]
    assert b_blocks[:3] == a_blocks[:3]
    assert [blk.ref_cnt for blk in b_blocks] == [2, 2, 2, 1]
    assert list(new.block_ids) == [blk.block_id for blk in b_blocks]
    s.kv.check_invariants()


def test_hit_stops_one_token_short_of_the_whole_prompt():
    kv = KVCacheManager(num_blocks=20, block_size=16)
    allocate(kv, make_request("a", make_prompt(64)))
    # The same 48 tokens again: the last token must be computed, so only 2 blocks may hit.
    blocks, num_tokens = kv.get_computed_blocks(make_request("b", make_prompt(48)))
    assert (len(blocks), num_tokens) == (2, 32)
    blocks, num_tokens = kv.get_computed_blocks(make_request("c", make_prompt(49)))
    assert (len(blocks), num_tokens) == (3, 48)


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(num_blocks=20, block_size=16)
    allocate(kv, make_request("a", make_prompt(40), salt="tenant-1"))
    assert kv.get_computed_blocks(make_request("b", make_prompt(40), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", make_prompt(40), salt="tenant-1"))[1] == 32
    assert kv.get_computed_blocks(make_request("d", make_prompt(40)))[1] == 0


def test_the_lora_adapter_separates_identical_prompts():
    """Two adapters (or an adapter and the base model) never share a cached prefix; a salt that
    spells an adapter's key does not pose as it."""
    kv = KVCacheManager(num_blocks=20, block_size=16)
    one, two = LoRARequest("one", 1, "/adapters/one"), LoRARequest("two", 2, "/adapters/two")

    def request(req_id: str, lora=None, salt=None) -> Request:
        return Request(req_id, make_prompt(40), PARAMS, cache_salt=salt, lora=lora)

    allocate(kv, request("a", one))
    assert kv.get_computed_blocks(request("b", two))[1] == 0
    assert kv.get_computed_blocks(request("c"))[1] == 0
    assert kv.get_computed_blocks(request("d", salt=one.cache_key))[1] == 0
    assert kv.get_computed_blocks(request("e", LoRARequest("one", 1, "/adapters/one")))[1] == 32
    allocate(kv, request("f"))
    assert kv.get_computed_blocks(request("g"))[1] == 32
    assert kv.get_computed_blocks(request("h", two))[1] == 0


def test_a_step_mixes_at_most_max_loras_adapters():
    """A waiting request of a third adapter waits (FCFS) until a running one's adapter leaves."""
    s = make_scheduler(block_size=16)
    s.max_loras = 2
    loras = [LoRARequest(f"l{i}", i, f"/adapters/{i}") for i in (1, 2, 3)]
    first = [s.add_request(make_prompt(8, 100 * i), PARAMS, lora=lora)
             for i, lora in enumerate([loras[0], loras[1], loras[0], loras[2], None], 1)]
    so, _ = run_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == [r.wire_id for r in first[:3]]
    assert [r.lora.id for r in so.scheduled_new_reqs] == [1, 2, 1]
    assert so.scheduled_new_reqs[1].lora.path == "/adapters/2"
    for _ in range(PARAMS.max_tokens + 1):
        so, _ = run_step(s)
        if so.scheduled_new_reqs:
            break
    assert [r.lora.id for r in so.scheduled_new_reqs] == [3, 0]
    assert all(r.wire_id not in s.requests for r in first[:3])  # admitted once those ended


def test_a_scheduler_without_lora_slots_refuses_an_adapter_request():
    with pytest.raises(InvalidRequestError, match="--max-loras") as refused:
        make_scheduler().add_request(make_prompt(8), PARAMS, lora=LoRARequest("a", 1, "/a"))
    assert refused.value.field == "lora"


def test_a_different_first_block_breaks_the_chain():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    allocate(kv, make_request("a", make_prompt(16)))
    other = make_prompt(16)
    other[0] = 99  # later blocks are equal token-wise, but their parents differ
    assert kv.get_computed_blocks(make_request("b", other))[1] == 0


def test_freed_blocks_join_the_free_queue_last_block_first():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", make_prompt(16))
    b = make_request("b", make_prompt(8, 300))
    a_ids, b_ids = allocate(kv, a), allocate(kv, b)
    assert a_ids == [1, 2, 3, 4] and b_ids == [5, 6]
    assert [blk.block_id for blk in kv.pool.free_queue] == [7, 8, 9]
    assert kv.usage == pytest.approx(6 / 9)
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0
    # Never-used blocks stay in front; then each freed request's tail comes before its prefix.
    assert [blk.block_id for blk in kv.pool.free_queue] == [7, 8, 9, 4, 3, 2, 1, 6, 5]
    kv.check_invariants()


def test_a_miss_evicts_the_least_recently_used_cached_block():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = make_request("a", make_prompt(8, 100))
    b = make_request("b", make_prompt(8, 200))
    allocate(kv, a)
    allocate(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 4  # everything free is cached
    a_tail, a_head = kv.pool.blocks[2], kv.pool.blocks[1]
    lru_hash = a_tail.block_hash
    c = make_request("c", make_prompt(3, 900))  # a miss that needs one block
    assert allocate(kv, c) == [a_tail.block_id]
    assert kv.pool.get_cached_block(lru_hash) is None and a_tail.block_hash is None
    # a's first block and all of b's survive.
    assert kv.get_computed_blocks(make_request("a2", make_prompt(9, 100))) == ([a_head], 4)
    assert kv.get_computed_blocks(make_request("b2", make_prompt(9, 200)))[1] == 8
    kv.check_invariants()


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", make_prompt(9))
    allocate(kv, a)
    kv.free(a)
    free_before = kv.num_free_blocks
    b = make_request("b", make_prompt(9))
    blocks = allocate(kv, b)
    assert blocks[:2] == [1, 2]  # both full blocks of a, reused
    assert kv.num_free_blocks == free_before - 3
    assert all(kv.pool.blocks[i] not in list(kv.pool.free_queue) for i in blocks)
    kv.free(b)
    kv.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    big = make_request("big", make_prompt(20))
    assert kv.allocate_slots(big, 20) is None
    assert big.wire_id not in kv.req_to_blocks and kv.num_free_blocks == 3
    kv.check_invariants()


def test_invariant_check_catches_a_leak():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.check_invariants()  # in use is fine while not idle
    try:
        pool.check_invariants(idle=True)
    except AssertionError as e:
        assert "still referenced" in str(e)
    else:
        raise AssertionError("a referenced block passed the idle check")
    pool.free_blocks([block])
    pool.check_invariants(idle=True)


def test_prefix_caching_off_never_hits():
    s = make_scheduler(block_size=16, enable_prefix_caching=False)
    s.add_request(make_prompt(48), PARAMS)
    run_step(s)
    s.add_request(make_prompt(60), PARAMS)
    so, _ = run_step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert not s.kv.pool.cached
