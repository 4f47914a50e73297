"""The scheduler's side of a step with fake model outputs: which requests get a bitmask row,
what it allows, and how the matchers follow accepted tokens through preemption and to the end."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_svc import SamplingParams
from scheduler_svc.core.structured_output.compiler import unpack_row
from tests.scheduler.conftest import fake_output, make_prompt, make_scheduler

from .conftest import COLOURS

VOCAB = 49152
EOS = 2


@pytest.fixture
def scheduler(default_tokenizer):
    return make_scheduler(vocab_size=VOCAB, eos_token_ids=(EOS,), tokenizer=default_tokenizer,
                          max_num_batched_tokens=64, long_prefill_token_threshold=0)


def rows(grammar_output) -> dict[str, set[int]]:
    """Wire id -> the token ids its bitmask row allows."""
    words = np.frombuffer(grammar_output.bitmask, dtype="<i4").reshape(
        len(grammar_output.req_ids), -1)
    return {r: set(np.flatnonzero(unpack_row(w, VOCAB)).tolist())
            for r, w in zip(grammar_output.req_ids, words, strict=True)}


def first_tokens(tokenizer, texts) -> set[int]:
    return {tokenizer(t, add_special_tokens=False).input_ids[0] for t in texts}


def test_only_constrained_requests_that_sample_get_a_row(scheduler, default_tokenizer):
    free = scheduler.add_request(make_prompt(8), SamplingParams(temperature=0))
    so = scheduler.schedule()
    assert scheduler.get_grammar_bitmask(so) is None  # nothing constrained: no bitmask at all
    scheduler.update_from_output(so, fake_output(scheduler, so))

    # 100 prompt tokens at 64 a step: the first step is mid-prefill and samples nothing.
    colour = scheduler.add_request(make_prompt(100, start=500),
                                   SamplingParams(temperature=0, choice=COLOURS))
    so = scheduler.schedule()
    assert scheduler.get_grammar_bitmask(so) is None
    scheduler.update_from_output(so, fake_output(scheduler, so))
    so = scheduler.schedule()
    grammar_output = scheduler.get_grammar_bitmask(so)
    assert list(grammar_output.req_ids) == [colour.wire_id]  # the free request has no row
    allowed = rows(grammar_output)[colour.wire_id]
    assert first_tokens(default_tokenizer, COLOURS) <= allowed
    assert all(any(c.startswith(default_tokenizer.decode([t])) for c in COLOURS) for t in allowed)
    assert free.wire_id not in grammar_output.req_ids


def test_matcher_follows_accepted_tokens_through_preemption(scheduler, default_tokenizer):
    tokens = default_tokenizer("dark purple", add_special_tokens=False).input_ids
    assert len(tokens) > 1
    request = scheduler.add_request(make_prompt(10), SamplingParams(temperature=0,
                                                                    choice=COLOURS))
    so = scheduler.schedule()
    scheduler.get_grammar_bitmask(so)
    scheduler.update_from_output(so, fake_output(scheduler, so, tokens[0]))

    # Preempted: its KV cache is dropped and recomputed, prompt and output alike.
    scheduler.running.remove(request)
    scheduler._preempt(request)
    so = scheduler.schedule()
    assert request.wire_id in so.scheduled_cached_reqs.resumed_req_ids
    grammar_output = scheduler.get_grammar_bitmask(so)
    allowed = rows(grammar_output)[request.wire_id]
    # The matcher is where the sampled token left it: the rest of "dark purple", no new start.
    assert tokens[1] in allowed
    assert not first_tokens(default_tokenizer, ["red", "green", "blue"]) & allowed


def test_the_grammar_ends_its_request_with_stop(scheduler, default_tokenizer):
    (red,) = default_tokenizer("red", add_special_tokens=False).input_ids
    request = scheduler.add_request(make_prompt(10), SamplingParams(
        temperature=0, choice=COLOURS, ignore_eos=True, max_tokens=50))
    so = scheduler.schedule()
    scheduler.get_grammar_bitmask(so)
    (out,) = scheduler.update_from_output(so, fake_output(scheduler, so, red))
    assert not out.finished
    so = scheduler.schedule()
    assert rows(scheduler.get_grammar_bitmask(so)) == {request.wire_id: {EOS}}
    # ignore_eos keeps the stop rules from ending it: the terminated grammar does.
    (out,) = scheduler.update_from_output(so, fake_output(scheduler, so, EOS))
    assert out.finished and out.finish_reason == "stop"
    assert out.new_token_ids == [EOS]
    assert scheduler.get_num_unfinished_requests() == 0
    assert not scheduler._constrained  # its matcher is gone with it
