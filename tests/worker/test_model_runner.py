"""The runner's persistent batch, input layout and two-call protocol, on a tiny real model."""

from __future__ import annotations

import numpy as np
import pytest
from batchwire.v1 import worker_pb2 as pb

from tests.worker.step_driver import StepDriver, greedy
from worker_svc.batch.validation import InvalidStepError


def new_req(req_id, prompt, blocks, computed, scheduled, sampling=None):
    return pb.NewRequestData(
        req_id=req_id, prompt_token_ids=prompt, sampling=sampling or greedy(), block_ids=blocks,
        num_computed_tokens=computed, num_scheduled_tokens=scheduled,
    )  # fmt: skip


def step(new=(), cached=(), finished=()):
    """cached: (req_id, new_blocks, computed, scheduled[, resumed]) tuples."""
    so = pb.SchedulerOutput(finished_req_ids=list(finished))
    so.scheduled_new_reqs.extend(new)
    c = so.scheduled_cached_reqs
    for req_id, blocks, computed, scheduled, *resumed in cached:
        c.req_ids.append(req_id)
        if resumed and resumed[0]:
            c.resumed_req_ids.append(req_id)
        c.new_block_ids.add().ids.extend(blocks)
        c.num_computed_tokens.append(computed)
        c.num_scheduled_tokens.append(scheduled)
    so.total_num_scheduled_tokens = sum(r.num_scheduled_tokens for r in new) + sum(
        c.num_scheduled_tokens
    )
    return so


def prompt(n, start=5):
    return [(start + i) % 500 for i in range(n)]


def run_step(runner, so, grammar=None):
    out = runner.execute_model(so)
    return out if out is not None else runner.sample_tokens(grammar)


def test_walkthrough_pass_layout(llama_worker):
    """The walkthrough's pass: [2, 5, 3] scheduled, 100/0/40 computed of 102/600/60 tokens."""
    runner = llama_worker.runner
    so = step(new=[
        new_req("r1", prompt(102), list(range(1, 8)), 100, 2),
        new_req("r2", prompt(600), [8], 0, 5),
        new_req("r3", prompt(60), [9, 10, 11], 40, 3),
    ])  # fmt: skip
    runner._update_states(so)
    logits_indices, discard, meta, spec = runner._prepare_inputs(so)
    assert runner.positions_np[:10].tolist() == [100, 101, 0, 1, 2, 3, 4, 40, 41, 42]
    assert meta.query_start_loc.tolist() == [0, 2, 7, 10]
    assert runner.query_start_loc_np[4:].tolist() == [10] * (len(runner.query_start_loc_np) - 4)
    assert logits_indices.tolist() == [1, 6, 9]
    assert discard.tolist() == [False, True, True]
    assert spec is None  # no drafts
    # Slot of r1's position 100: block_table[0][100 // 16] * 16 + 100 % 16 = 7 * 16 + 4.
    assert meta.slot_mapping[:2].tolist() == [7 * 16 + 4, 7 * 16 + 5]
    assert meta.slot_mapping[7:10].tolist() == [11 * 16 + 8, 11 * 16 + 9, 11 * 16 + 10]
    assert runner.input_ids[:10].tolist() == [
        prompt(102)[100],
        prompt(102)[101],
        *prompt(600)[:5],
        *prompt(60)[40:43],
    ]


def test_walkthrough_pass_samples_only_the_finished_prefill(llama_worker):
    so = step(new=[
        new_req("r1", prompt(102), list(range(1, 8)), 100, 2),
        new_req("r2", prompt(600), [8], 0, 5),
        new_req("r3", prompt(60), [9, 10, 11], 40, 3),
    ])  # fmt: skip
    assert llama_worker.execute_model(so) is None  # logits parked
    out = llama_worker.sample_tokens(None)
    assert list(out.req_ids) == ["r1", "r2", "r3"]
    assert [len(t.ids) for t in out.sampled_token_ids] == [1, 0, 0]
    assert llama_worker.runner.requests["r1"].output_token_ids == list(out.sampled_token_ids[0].ids)


def test_two_calls_are_enforced(llama_worker):
    so = step(new=[new_req("a", prompt(5), [1], 0, 5)])
    assert llama_worker.execute_model(so) is None
    with pytest.raises(RuntimeError, match="sample_tokens"):
        llama_worker.execute_model(step(cached=[("a", [], 5, 1)]))
    assert len(llama_worker.sample_tokens(None).sampled_token_ids[0].ids) == 1
    # Nothing parked now: an empty output, not an error.
    assert llama_worker.sample_tokens(None) == pb.ModelRunnerOutput()


def test_zero_token_step_applies_the_diff(llama_worker):
    runner = llama_worker.runner
    run_step(
        runner, step(new=[new_req("a", prompt(5), [1], 0, 5), new_req("b", prompt(7), [2], 0, 7)])
    )
    out = runner.execute_model(step(finished=["a"]))
    assert out == pb.ModelRunnerOutput()  # returned directly: nothing to sample
    assert "a" not in runner.requests and runner.input_batch.num_reqs == 0
    assert "b" in runner.requests  # not scheduled, still held


def test_row_moves_but_identity_stays(llama_worker):
    runner = llama_worker.runner
    batch = runner.input_batch
    run_step(
        runner, step(new=[new_req(r, prompt(4, i), [i + 1], 0, 4) for i, r in enumerate("abc")])
    )
    assert batch.req_id_to_index == {"a": 0, "b": 1, "c": 2}
    c_state = runner.requests["c"]
    c_tokens = batch.token_ids_np[2, : batch.num_tokens_np[2]].copy()
    run_step(runner, step(cached=[("b", [], 4, 1), ("c", [], 4, 1)], finished=["a"]))
    # condense() moved c from the highest row into a's hole; b stayed put.
    assert batch.req_id_to_index == {"c": 0, "b": 1}
    assert runner.requests["c"] is c_state
    assert batch.token_ids_np[0, : len(c_tokens)].tolist() == c_tokens.tolist()
    assert batch.block_table.table_np[0, 0] == 3


def test_unscheduled_request_keeps_state_and_returns(llama_worker):
    runner = llama_worker.runner
    batch = runner.input_batch
    run_step(
        runner,
        step(new=[new_req("a", prompt(20), [1, 2], 0, 20), new_req("b", prompt(6), [3], 0, 6)]),
    )
    a_out = list(runner.requests["a"].output_token_ids)
    run_step(runner, step(cached=[("b", [], 6, 1)]))  # a is held but not scheduled
    assert "a" not in batch.req_id_to_index and "a" in runner.requests
    run_step(runner, step(cached=[("a", [], 20, 1), ("b", [], 7, 1)]))
    row = batch.req_id_to_index["a"]
    assert batch.num_tokens_np[row] == 20 + 2
    assert batch.token_ids_np[row, :21].tolist() == prompt(20) + a_out
    assert batch.block_table.table_np[row, :2].tolist() == [1, 2]


def test_resumed_blocks_replaced_running_appended(llama_worker):
    runner = llama_worker.runner
    table = runner.input_batch.block_table
    run_step(
        runner,
        step(new=[new_req("a", prompt(16), [1], 0, 16), new_req("b", prompt(16), [2], 0, 16)]),
    )
    # a runs on and needs a second block; b was preempted and comes back on new blocks.
    run_step(runner, step(cached=[("a", [5], 16, 1), ("b", [7, 8], 0, 17, True)]))
    rows = runner.input_batch.req_id_to_index
    assert table.table_np[rows["a"], : table.num_blocks_per_row[rows["a"]]].tolist() == [1, 5]
    assert table.table_np[rows["b"], : table.num_blocks_per_row[rows["b"]]].tolist() == [7, 8]
    assert runner.requests["b"].block_ids == [7, 8]


def test_finished_id_that_returns_is_new(llama_worker):
    runner = llama_worker.runner
    run_step(runner, step(new=[new_req("a", prompt(8), [1], 0, 8)]))
    out = run_step(runner, step(new=[new_req("a", prompt(3, 50), [2], 0, 3)], finished=["a"]))
    state = runner.requests["a"]
    assert state.prompt_token_ids == prompt(3, 50)
    assert state.output_token_ids == list(out.sampled_token_ids[0].ids)


def test_sampling_metadata_reused_until_membership_changes(llama_worker):
    runner = llama_worker.runner
    run_step(
        runner, step(new=[new_req("a", prompt(8), [1], 0, 8), new_req("b", prompt(8), [2], 0, 8)])
    )
    meta = runner.input_batch.sampling_metadata
    run_step(runner, step(cached=[("a", [], 8, 1), ("b", [], 8, 1)]))
    assert runner.input_batch.sampling_metadata is meta
    run_step(runner, step(cached=[("b", [], 9, 1)], finished=["a"]))
    assert runner.input_batch.sampling_metadata is not meta


BAD_STEPS = {
    "unknown request": lambda: step(cached=[("zzz", [], 0, 1)]),
    "block outside the pool": lambda: step(new=[new_req("n", prompt(4), [10**6], 0, 4)]),
    "null block": lambda: step(new=[new_req("n", prompt(4), [0], 0, 4)]),
    "more tokens than the request has": lambda: step(cached=[("a", [], 8, 5)]),
    "token outside the vocabulary": lambda: step(new=[new_req("n", [1, 2, 100_000], [3], 0, 3)]),
    "output token outside the vocabulary": lambda: step(
        new=[pb.NewRequestData(
            req_id="n", prompt_token_ids=[1, 2], output_token_ids=[3, 100_000], sampling=greedy(),
            block_ids=[3], num_computed_tokens=0, num_scheduled_tokens=4,
        )]
    ),  # fmt: skip
    "too few blocks": lambda: step(new=[new_req("n", prompt(40), [3], 0, 40)]),
    "wrong total": lambda: pb.SchedulerOutput(
        scheduled_new_reqs=[new_req("n", prompt(4), [3], 0, 4)], total_num_scheduled_tokens=9
    ),
    # A block twice in one request's table: its two positions would share one slot's KV.
    "block listed twice": lambda: step(new=[new_req("n", prompt(20), [3, 3], 0, 20)]),
    "new block already held": lambda: step(cached=[("a", [1], 8, 1)]),
    # The worker is a service of its own: sampling values are checked here too (NaN included).
    **{f"sampling {name}={value}": (lambda name=name, value=value: step(new=[new_req(
        "n", prompt(4), [3], 0, 4, pb.RequestSamplingParams(
            **{"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, name: value}))]))
       for name, value in [("temperature", float("nan")), ("temperature", -1.0),
                           ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 2.0),
                           ("top_p", float("nan")), ("min_p", 2.0), ("top_k", -2),
                           ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                           ("repetition_penalty", float("nan")), ("presence_penalty", 3.0),
                           ("frequency_penalty", float("nan")), ("min_tokens", -1)]},
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_is_refused_and_changes_nothing(llama_worker, case):
    runner = llama_worker.runner
    batch = runner.input_batch
    run_step(
        runner, step(new=[new_req("a", prompt(8), [1], 0, 8), new_req("b", prompt(8), [2], 0, 8)])
    )
    before = (
        dict(batch.req_id_to_index), batch.token_ids_np.copy(), batch.num_tokens_np.copy(),
        batch.num_computed_tokens_np.copy(), batch.block_table.table_np.copy(),
        {k: (list(v.block_ids), v.num_computed_tokens) for k, v in runner.requests.items()},
    )  # fmt: skip
    with pytest.raises(InvalidStepError):
        runner.execute_model(BAD_STEPS[case]())
    after = (
        dict(batch.req_id_to_index), batch.token_ids_np.copy(), batch.num_tokens_np.copy(),
        batch.num_computed_tokens_np.copy(), batch.block_table.table_np.copy(),
        {k: (list(v.block_ids), v.num_computed_tokens) for k, v in runner.requests.items()},
    )  # fmt: skip
    assert before[0] == after[0] and before[5] == after[5]
    for x, y in zip(before[1:5], after[1:5], strict=True):
        np.testing.assert_array_equal(x, y)
    # And the worker carries on with a good step.
    out = run_step(runner, step(cached=[("a", [], 8, 1), ("b", [], 8, 1)]))
    assert [len(t.ids) for t in out.sampled_token_ids] == [1, 1]


def test_grammar_bitmask_restricts_only_its_row(llama_worker):
    runner = llama_worker.runner
    vocab = runner.vocab_size
    so = step(new=[new_req("a", prompt(8), [1], 0, 8), new_req("b", prompt(8), [2], 0, 8)])
    free = run_step(runner, so)
    runner.reset()
    allowed = 123
    words = np.zeros((1, -(-vocab // 32)), dtype="<i4")
    words[0, allowed // 32] = 1 << (allowed % 32)
    assert runner.execute_model(so) is None
    out = runner.sample_tokens(pb.GrammarOutput(req_ids=["b"], bitmask=words.tobytes()))
    assert list(out.sampled_token_ids[1].ids) == [allowed]
    assert list(out.sampled_token_ids[0].ids) == list(free.sampled_token_ids[0].ids)


def test_bad_grammar_output_keeps_logits_parked(llama_worker):
    runner = llama_worker.runner
    assert runner.execute_model(step(new=[new_req("a", prompt(8), [1], 0, 8)])) is None
    with pytest.raises(InvalidStepError, match="bytes"):
        runner.sample_tokens(pb.GrammarOutput(req_ids=["a"], bitmask=b"\x00" * 3))
    with pytest.raises(InvalidStepError, match="not in this step"):
        runner.sample_tokens(
            pb.GrammarOutput(req_ids=["x"], bitmask=b"\x00" * 4 * (runner.vocab_size // 32))
        )
    # A row that allows no token would silently sample token 0.
    with pytest.raises(InvalidStepError, match="allows no token"):
        runner.sample_tokens(
            pb.GrammarOutput(req_ids=["a"], bitmask=b"\x00" * 4 * (-(-runner.vocab_size // 32)))
        )
    # Two rows for one request, each allowing one token, together allowing none: refused
    # (found by tests/fuzz; it sampled token 0).
    words = -(-runner.vocab_size // 32)
    twice = b"\x01" + b"\x00" * (4 * words - 1) + b"\x02" + b"\x00" * (4 * words - 1)
    with pytest.raises(InvalidStepError, match="twice"):
        runner.sample_tokens(pb.GrammarOutput(req_ids=["a", "a"], bitmask=twice))
    assert len(runner.sample_tokens(None).sampled_token_ids[0].ids) == 1


def test_logprobs_reported_for_rows_that_asked(llama_worker):
    runner = llama_worker.runner
    with_lp = pb.RequestSamplingParams(
        temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=3
    )
    out = run_step(
        runner,
        step(new=[new_req("a", prompt(8), [1], 0, 8, with_lp), new_req("b", prompt(8), [2], 0, 8)]),
    )
    lp = out.logprobs[0]
    assert lp.token_ids[0] == out.sampled_token_ids[0].ids[0]
    assert len(lp.token_ids) == 4 and lp.sampled_token_rank == 1  # greedy picks the top token
    assert lp.logprobs[0] == pytest.approx(lp.logprobs[1])
    assert len(out.logprobs[1].token_ids) == 0


def test_preempted_request_recomputes_to_the_same_tokens(tiny_checkpoints):
    from tests.worker.conftest import tiny_worker

    prompts = {"a": prompt(30, 7), "b": prompt(21, 90)}
    plain = StepDriver(tiny_worker(tiny_checkpoints["llama"]).runner, 64, 16, chunk=8)
    for r, p in prompts.items():
        plain.add(r, p, 12)
    expected = plain.run()

    worker = tiny_worker(tiny_checkpoints["llama"])
    driver = StepDriver(worker.runner, 64, 16, chunk=8)
    for r, p in prompts.items():
        driver.add(r, p, 12)
    for _ in range(7):
        driver.step()
    driver.preempt("a")
    driver.active["a"].paused = True
    driver.step()
    driver.active["a"].paused = False
    assert driver.run() == expected


def test_seeded_tokens_do_not_depend_on_prefill_chunking(tiny_checkpoints):
    from tests.worker.conftest import tiny_worker

    seeded = pb.RequestSamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0, seed=1234)
    outputs = []
    for chunk in (4, 1000):
        worker = tiny_worker(tiny_checkpoints["llama"])
        driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=chunk)
        driver.add("s", prompt(37, 11), 10, seeded)
        outputs.append(driver.run()["s"])
    assert outputs[0] == outputs[1]


def test_moved_request_continues_as_if_it_had_never_moved(tiny_checkpoints):
    """A request arriving with output_token_ids (moved from another worker) recomputes them,
    counts them as output for the penalties and skips its seeded generator past their draws."""
    from tests.worker.conftest import tiny_worker

    sampling = pb.RequestSamplingParams(
        temperature=0.9, top_p=0.95, seed=77, frequency_penalty=0.6, presence_penalty=0.4,
        repetition_penalty=1.3,
    )  # fmt: skip
    worker = tiny_worker(tiny_checkpoints["llama"])
    undisturbed = StepDriver(worker.runner, worker.num_blocks, 16)
    undisturbed.add("m", prompt(19, 5), 24, sampling)
    expected = undisturbed.run()["m"]

    worker.reset()
    moved = StepDriver(worker.runner, worker.num_blocks, 16, chunk=16)
    moved.add("m", prompt(19, 5), 24, sampling)
    moved.active["m"].output = expected[:9]  # what the first worker had produced
    assert moved.run()["m"] == expected
