"""The bulk check of a steady decode step refuses exactly what the per-request loop refuses, with
the same message: every field of a valid 64-request step is broken in turn, and each broken step
is validated twice, with the bulk check and with it turned off (the reference)."""

from __future__ import annotations

import copy
import random

import pytest
from batchwire.v1 import worker_pb2 as pb

import worker_svc.batch.validation as validation
from worker_svc.batch.input_batch import CachedRequestState
from worker_svc.batch.validation import InvalidStepError, StepLimits, validate_scheduler_output

LIMITS = StepLimits(vocab_size=512, num_blocks=400, block_size=16, max_model_len=96,
                    max_num_reqs=64, max_num_batched_tokens=256, max_logprobs=5)


def held_requests(n: int = 64) -> dict[str, CachedRequestState]:
    rng = random.Random(0)
    requests = {}
    for i in range(n):
        num_tokens = rng.randint(5, 60)
        requests[f"r{i}"] = CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=[7] * (num_tokens - 1),
            sampling=pb.RequestSamplingParams(),
            generator=None, block_ids=[1 + 4 * i + b for b in range(-(-(num_tokens - 1) // 16))],
            num_computed_tokens=num_tokens - 1, output_token_ids=[9],
        )  # fmt: skip
    return requests


def steady_step(requests: dict[str, CachedRequestState]) -> pb.SchedulerOutput:
    so = pb.SchedulerOutput(total_num_scheduled_tokens=len(requests))
    cached = so.scheduled_cached_reqs
    for req_id, state in requests.items():
        cached.req_ids.append(req_id)
        entry = cached.new_block_ids.add()
        if (state.num_tokens - 1) % 16 == 0:  # its blocks are full: its last token needs one more
            entry.ids.append(300 + int(req_id[1:]))
        cached.num_computed_tokens.append(state.num_tokens - 1)
        cached.num_scheduled_tokens.append(1)
    return so


def break_step(so: pb.SchedulerOutput, how: str, i: int) -> pb.SchedulerOutput:
    so = copy.deepcopy(so)
    c = so.scheduled_cached_reqs
    if how == "empty id":
        c.req_ids[i] = ""
    elif how == "unknown id":
        c.req_ids[i] = "nobody"
    elif how == "twice":
        c.req_ids[i] = c.req_ids[(i + 1) % len(c.req_ids)]
    elif how == "finished":
        so.finished_req_ids.append(c.req_ids[i])
    elif how == "null block":
        c.new_block_ids[i].ids.append(0)
    elif how == "block outside the pool":
        c.new_block_ids[i].ids.append(LIMITS.num_blocks)
    elif how == "negative computed":
        c.num_computed_tokens[i] = -1
    elif how == "negative scheduled":
        c.num_scheduled_tokens[i] = -1
        so.total_num_scheduled_tokens -= 2
    elif how == "too many scheduled":
        c.num_scheduled_tokens[i] = 2
        so.total_num_scheduled_tokens += 1
    elif how == "recompute":  # legal: fewer computed tokens, more scheduled
        c.num_computed_tokens[i] -= 1
        c.num_scheduled_tokens[i] += 1
        so.total_num_scheduled_tokens += 1
    elif how == "block missing":  # the first request from i on that needed a new block
        i = next(j for j in range(i, i + len(c.req_ids)) if c.new_block_ids[j % len(c.req_ids)].ids)
        del c.new_block_ids[i % len(c.req_ids)].ids[:]
    elif how == "too many blocks":
        c.new_block_ids[i].ids.extend(range(350, 357))
    elif how == "resumed without blocks":
        c.resumed_req_ids.append(c.req_ids[i])
    elif how == "wrong total":
        so.total_num_scheduled_tokens += 1
    elif how == "new request with a cached id":
        so.scheduled_new_reqs.add(
            req_id=c.req_ids[i], prompt_token_ids=[5, 6], block_ids=[399], num_computed_tokens=0,
            num_scheduled_tokens=2, sampling=pb.RequestSamplingParams(),
        )  # fmt: skip
        so.total_num_scheduled_tokens += 2
    return so


def outcome(so, requests, limits, bulk: bool, monkeypatch) -> str:
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(validation, "_cached_requests_valid", lambda *a: False)
        try:
            validate_scheduler_output(so, requests, limits)
        except InvalidStepError as e:
            return f"refused: {e}"
    return "accepted"


HOW = ["none", "empty id", "unknown id", "twice", "finished", "null block",
       "block outside the pool", "negative computed", "negative scheduled", "too many scheduled",
       "recompute", "block missing", "too many blocks", "resumed without blocks", "wrong total",
       "new request with a cached id"]


def assert_bulk_agrees_with_the_loop(so, how, requests, monkeypatch) -> None:
    """The step broken `how` at three positions: the bulk check's outcome is the loop's."""
    seen = set()
    for i in (0, 17, 63):
        broken = break_step(so, how, i)
        bulk = outcome(broken, requests, LIMITS, True, monkeypatch)
        assert bulk == outcome(broken, requests, LIMITS, False, monkeypatch), (how, i)
        seen.add(bulk.split(":")[0])
    assert seen == ({"accepted"} if how in ("none", "recompute") else {"refused"}), (how, seen)


@pytest.mark.parametrize("how", HOW)
def test_bulk_check_agrees_with_the_loop(how, monkeypatch):
    requests = held_requests()
    so = steady_step(requests)
    assert any(b.ids for b in so.scheduled_cached_reqs.new_block_ids)
    # The valid step takes the bulk path (else this table would test the loop twice).
    assert validation._cached_requests_valid(so.scheduled_cached_reqs, requests, set(), set(),
                                             set(), LIMITS)
    assert_bulk_agrees_with_the_loop(so, how, requests, monkeypatch)


def test_bulk_check_at_max_model_len(monkeypatch):
    """A request holding max_model_len tokens may not sample again; one below it may."""
    requests = held_requests()
    state = requests["r5"]
    for extra, expected in ((LIMITS.max_model_len - state.num_tokens, "refused"),
                            (LIMITS.max_model_len - state.num_tokens - 1, "accepted")):
        grown = copy.deepcopy(requests)
        grown["r5"].output_token_ids.extend([9] * extra)
        grown["r5"].block_ids = list(range(200, 206))
        so = steady_step(grown)
        del so.scheduled_cached_reqs.new_block_ids[5].ids[:]
        bulk = outcome(so, grown, LIMITS, True, monkeypatch)
        assert bulk == outcome(so, grown, LIMITS, False, monkeypatch)
        assert bulk.startswith(expected), bulk


def no_block_step(requests: dict[str, CachedRequestState]) -> pb.SchedulerOutput:
    """A steady step between block boundaries: every new_block_ids entry is empty."""
    for state in requests.values():  # room in the held blocks for the token scheduled now
        state.block_ids.append(399 - len(state.block_ids) - 4 * int(state.req_id[1:]) % 50)
    so = steady_step(requests)
    for entry in so.scheduled_cached_reqs.new_block_ids:
        del entry.ids[:]
    return so


@pytest.mark.parametrize("how", [h for h in HOW if h != "block missing"])
def test_bulk_check_of_a_step_that_adds_no_block_agrees_with_the_loop(how, monkeypatch):
    """The shortcut that reads no new_block_ids entry (their serialized size says they are all
    empty) refuses what the loop refuses; a broken entry takes the entry-by-entry path."""
    requests = held_requests()
    so = no_block_step(requests)
    cached = so.scheduled_cached_reqs
    assert validation.no_block_added(cached)
    req_ids = list(cached.req_ids)
    assert validation._cached_requests_valid(cached, requests, set(), set(), set(), LIMITS,
                                             req_ids, True)
    assert validate_scheduler_output(so, requests, LIMITS).no_new_blocks
    assert_bulk_agrees_with_the_loop(so, how, requests, monkeypatch)


def test_no_block_added_reads_every_entry_exactly():
    """Any entry with an id, or with bytes the schema does not know, counts as not empty."""
    so = no_block_step(held_requests())
    cached = so.scheduled_cached_reqs
    assert validation.no_block_added(cached)
    assert validation.no_block_added(pb.CachedRequestData())
    for i in (0, 31, 63):
        grown = copy.deepcopy(cached)
        grown.new_block_ids[i].ids.append(5)
        assert not validation.no_block_added(grown)
        unknown = copy.deepcopy(cached)
        unknown.new_block_ids[i].MergeFromString(b"\x10\x01")  # field 2: unknown to BlockIds
        assert not validation.no_block_added(unknown)
