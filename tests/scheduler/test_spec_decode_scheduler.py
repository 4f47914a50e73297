"""Speculative decoding in the scheduler: who gets drafts, the same tokens and stops as without
speculation (on the fake worker, whose KV is read back through the block tables), the computed
count corrected by the rejected drafts, and every block back in the pool at the end."""

from __future__ import annotations

import pytest
from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler_stats import SchedulerStats

from .conftest import (
    ByteTokenizer,
    make_fake_engine,
    make_scheduler,
    scheduled_tokens,
    update_with_text,
)
from .fake_worker import copy_next_token

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
CYCLE = [10, 11, 12, 13, 14, 15]  # the copy model repeats the last 6 tokens


@pytest.mark.parametrize("fields", [dict(speculative_method="eagle"),
                                    dict(num_speculative_tokens=0),
                                    dict(prompt_lookup_min=3, prompt_lookup_max=2),
                                    dict(prompt_lookup_min=0)])
def test_bad_speculative_settings_are_refused(fields):
    with pytest.raises(ValueError):
        SchedulerConfig(**fields)


def test_off_by_default():
    assert SchedulerConfig().speculative_method is None
    assert make_scheduler().spec is None


def run(engine, prompts, params, join_every: int = 0):
    """Runs the prompts (one joining every join_every steps, or all at once); returns the
    tokens, finish reasons and text per request and the number of steps."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple] = {}
    texts: dict[str, str] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_requests():
        if pending and (not join_every or steps % join_every == 0):
            i, prompt = pending.pop(0)
            engine.add_request(prompt, params, request_id=str(i))
            tokens[str(i)], texts[str(i)] = [], ""
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.stop_reason)
        steps += 1
    return tokens, ends, texts, steps


def check_idle(engine):
    """Every block back in the pool, the pool consistent."""
    kv = engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_blocks - 1, "blocks leaked"


COPY_PROMPTS = [CYCLE * 2, [20, 21, 22, 23, 24, 25] * 3 + [20], [30, 31] * 7, CYCLE[:5] + CYCLE]


@pytest.mark.parametrize("case", [
    dict(),  # plenty of blocks, everything at once
    dict(long_prefill_token_threshold=5, join_every=2),  # chunked prefill, joining mid-run
    dict(num_blocks=24, max_model_len=64, preempts=True),  # a pool too small for all four
])
def test_copy_model_same_tokens_as_without_speculation(case):
    case = dict(case)
    join_every, preempts = case.pop("join_every", 0), case.pop("preempts", False)
    engine_args = dict(num_blocks=case.pop("num_blocks", 200), block_size=4, vocab_size=64,
                       max_model_len=case.pop("max_model_len", 128),
                       next_token=copy_next_token, **case)
    params = SamplingParams(temperature=0, max_tokens=30)
    plain, plain_worker = make_fake_engine(**engine_args)
    spec, spec_worker = make_fake_engine(**engine_args, **SPEC)
    ref = run(plain, COPY_PROMPTS, params, join_every)
    got = run(spec, COPY_PROMPTS, params, join_every)
    assert got[:3] == ref[:3]
    assert all(len(t) == 30 for t in got[0].values())
    stats = spec.scheduler.stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9, stats
    assert got[3] < ref[3] / 2, "four tokens per step should halve the steps at least"
    if preempts:
        assert stats.num_preemptions > 0, "the small pool should have preempted"
    for engine in (plain, spec):
        check_idle(engine)
    # Drafts went only to decoding requests, 1 + d tokens each, within the step's budget.
    for so in spec_worker.seen_outputs:
        counts = scheduled_tokens(so)
        for entry in so.scheduled_spec_decode_tokens:
            assert 1 <= len(entry.ids) <= 3 and counts[entry.req_id] == 1 + len(entry.ids)
        assert so.total_num_scheduled_tokens == sum(counts.values())


def test_hash_model_rejects_most_drafts_and_keeps_the_same_tokens():
    """The default fake model's tokens are a hash: most drafts are wrong and are rejected."""
    prompts = [[(7 * i + j) % 5 + 2 for j in range(12)] for i in range(5)]  # few distinct ids
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, _ = make_fake_engine(num_blocks=100, block_size=4, vocab_size=8, max_model_len=64)
    spec, _ = make_fake_engine(num_blocks=100, block_size=4, vocab_size=8, max_model_len=64,
                               **SPEC)
    assert run(spec, prompts, params)[:3] == run(plain, prompts, params)[:3]
    stats = spec.scheduler.stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens < stats.num_draft_tokens
    check_idle(spec)


# Stops inside one multi-token step, on hand-made worker replies.

def decode_step(scheduler, so, tokens: list[int], logprobs: bool = False):
    """The worker's reply to step `so`: `tokens` for its one request, with a logprob per token."""
    out = worker_pb2.ModelRunnerOutput()
    (req_id,) = scheduled_tokens(so)
    out.req_ids.append(req_id)
    out.sampled_token_ids.add().ids.extend(tokens)
    if logprobs:
        positions = out.token_logprobs.add().positions
        for t in tokens:
            positions.add(token_ids=[t], logprobs=[-0.5], sampled_token_rank=1)
    return update_with_text(scheduler, so, out)


def two_steps(scheduler, params, prompt, step_tokens, logprobs=False):
    """Prefill (sampling CYCLE[0]), then one step that verifies 3 drafts and gets step_tokens."""
    request = scheduler.add_request(prompt, params)
    outs = decode_step(scheduler, scheduler.schedule(), [CYCLE[0]])
    so = scheduler.schedule()
    assert [list(e.ids) for e in so.scheduled_spec_decode_tokens] == [step_tokens[:3]]
    assert scheduled_tokens(so) == {request.wire_id: 4}
    outs += decode_step(scheduler, so, step_tokens, logprobs)
    return request, outs


def one_token_steps(scheduler, params, prompt, tokens):
    """The same tokens one step each, without speculation."""
    request = scheduler.add_request(prompt, params)
    outs = []
    for token in tokens:
        outs += decode_step(scheduler, scheduler.schedule(), [token])
        if outs[-1].finished:
            break
    return request, outs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[CYCLE[2]]),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=False),  # EOS = 2 below
])
def test_stop_token_on_the_second_of_four_tokens(params):
    eos = CYCLE[2] if not params.stop_token_ids else 99
    spec = make_scheduler(eos_token_ids=(eos,), **SPEC)
    plain = make_scheduler(eos_token_ids=(eos,))
    r, outs = two_steps(spec, params, CYCLE * 2, CYCLE[1:5], logprobs=True)
    ref, ref_outs = one_token_steps(plain, params, CYCLE * 2, CYCLE[:5])
    assert r.output_token_ids == ref.output_token_ids == CYCLE[:3]
    assert outs[-1].new_token_ids == CYCLE[1:3]  # the step's 3rd and 4th tokens are dropped
    assert len(outs[-1].new_logprobs) == 2
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (
        ref_outs[-1].finish_reason, ref_outs[-1].stop_reason)
    assert not spec.requests and spec.kv.num_free_blocks == spec.kv.pool.num_blocks - 1


def test_stop_string_on_the_second_of_four_tokens():
    # Tokens 1..6 decode to these bytes; "STOP" completes in the step's 2nd token.
    pieces = [b"ab", b"xS", b"TOPy", b"cd", b"ef", b"gh"]
    cycle = [1, 2, 3, 4, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=20, stop=["STOP"])
    tok = ByteTokenizer(pieces)
    spec = make_scheduler(vocab_size=7, eos_token_ids=(0,), tokenizer=tok, **SPEC)
    plain = make_scheduler(vocab_size=7, eos_token_ids=(0,), tokenizer=tok)
    prompt = cycle * 2
    request = spec.add_request(prompt, params)
    outs = decode_step(spec, spec.schedule(), [1])  # "ab"
    so = spec.schedule()
    assert [list(e.ids) for e in so.scheduled_spec_decode_tokens] == [[2, 3, 4]]
    outs += decode_step(spec, so, [2, 3, 4, 5])
    ref, ref_outs = one_token_steps(plain, params, prompt, [1, 2, 3, 4, 5])
    assert request.output_token_ids == ref.output_token_ids == [1, 2, 3]
    assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in ref_outs) == "abx"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "STOP")


def test_max_tokens_caps_the_drafts_and_ends_the_request_there():
    spec = make_scheduler(**SPEC)
    params = SamplingParams(temperature=0, max_tokens=3)
    request = spec.add_request(CYCLE * 2, params)
    decode_step(spec, spec.schedule(), [CYCLE[0]])
    so = spec.schedule()
    # One output token so far and max_tokens 3: one draft, so at most 3 tokens in all.
    assert [list(e.ids) for e in so.scheduled_spec_decode_tokens] == [[CYCLE[1]]]
    outs = decode_step(spec, so, CYCLE[1:3])
    assert request.output_token_ids == CYCLE[:3] and outs[-1].finish_reason == "length"


def test_rejected_drafts_are_recomputed_and_their_blocks_reused():
    spec = make_scheduler(block_size=4, **SPEC)
    request = spec.add_request(CYCLE * 2, SamplingParams(temperature=0, max_tokens=20))
    decode_step(spec, spec.schedule(), [CYCLE[0]])  # 13 tokens, 12 computed, 4 blocks
    so = spec.schedule()  # 1 + 3 drafts: positions 12..15, still 4 blocks
    assert request.num_computed_tokens == 16
    decode_step(spec, so, [CYCLE[1], 42])  # one draft accepted, then a correction
    assert request.num_tokens == 15 and request.num_computed_tokens == 14
    so = spec.schedule()
    # The correction (position 14) is computed again, with new drafts or without; the block
    # that held the rejected positions is reused.
    assert so.scheduled_cached_reqs.num_computed_tokens[0] == 14
    assert len(spec.kv.block_ids(request.wire_id)) == -(-(14 + scheduled_tokens(so)[
        request.wire_id]) // 4)


def test_stats_count_drafts_and_acceptances_per_position():
    stats = SchedulerStats()
    stats.record_verified(3, 3)
    stats.record_verified(3, 1)
    stats.record_verified(2, 0)
    assert (stats.num_spec_requests, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        3, 8, 4)
    assert stats.drafted_per_position == [3, 3, 2]
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == 0.5


def test_llm_keywords_and_cli_flags_turn_it_on():
    from scheduler_svc import LLM
    from scheduler_svc.cli.commands import _scheduler_config, build_parser
    from scheduler_svc.executors.uni import UniProcExecutor

    from .conftest import make_config
    from .fake_worker import FakeWorker

    worker = FakeWorker(num_blocks=40, block_size=4, vocab_size=64, max_model_len=64,
                        next_token=copy_next_token)
    llm = LLM(executor=UniProcExecutor(make_config(), worker), tokenizer=ByteTokenizer([b"a"] * 63),
              max_model_len=64, block_size=4, speculative_method="ngram", num_speculative_tokens=2)
    (out,) = llm.generate([CYCLE * 2], SamplingParams(temperature=0, max_tokens=12),
                          use_tqdm=False)
    assert out.token_ids == CYCLE * 2 and llm.engine.scheduler.stats.acceptance_rate == 1.0
    assert max(len(e.ids) for so in worker.seen_outputs
               for e in so.scheduled_spec_decode_tokens) == 2

    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command, "--speculative-method", "ngram",
                                          "--num-speculative-tokens", "6",
                                          "--prompt-lookup-min", "2", "--prompt-lookup-max", "5"])
        config = _scheduler_config(args)
        assert (config.speculative_method, config.num_speculative_tokens,
                config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 6, 2, 5)
    assert _scheduler_config(build_parser().parse_args(["serve"])).speculative_method is None
