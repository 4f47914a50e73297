"""Speculative decoding through the runner: the draft layout, token parity, bad draft fields."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from batchwire.v1 import worker_pb2 as pb

from scheduler_svc.core.ngram_proposer import NgramProposer
from tests.parity import assert_greedy_parity, hf_greedy
from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import DriverRequest, StepDriver, greedy
from tests.worker.test_model_runner import new_req, prompt, run_step, step
from worker_svc.batch.validation import InvalidStepError

K = 3  # drafts per request and step


def with_drafts(so: pb.SchedulerOutput, drafts: dict[str, list[int]]) -> pb.SchedulerOutput:
    for req_id, ids in drafts.items():
        so.scheduled_spec_decode_tokens.add(req_id=req_id, ids=ids)
    return so


def test_layout_of_a_step_with_drafts(llama_worker):
    """[r0 decoding with 3 drafts, r1 prefilling, r2 decoding without]: the walkthrough's
    metadata, worked by hand."""
    runner = llama_worker.runner
    run_step(runner, step(new=[
        new_req("r0", prompt(20), [1, 2], 0, 20),
        new_req("x", prompt(4), [3], 0, 4),
        new_req("r2", prompt(30), [4, 5], 0, 30),
    ]))  # fmt: skip
    r0_last = runner.requests["r0"].output_token_ids[-1]
    # x leaves; r1 takes its row, so the rows are r0, r1, r2.
    so = with_drafts(
        step(new=[new_req("r1", prompt(600), [6], 0, 5)],
             cached=[("r0", [], 20, 4), ("r2", [], 30, 1)], finished=["x"]),
        {"r0": [11, 12, 13]},
    )  # fmt: skip
    runner._update_states(so)
    assert runner.input_batch.req_id_to_index == {"r0": 0, "r1": 1, "r2": 2}
    logits_indices, discard, meta, spec = runner._prepare_inputs(so)

    assert runner.input_ids[:4].tolist() == [r0_last, 11, 12, 13]  # last token, then drafts
    assert runner.positions_np[:10].tolist() == [20, 21, 22, 23, 0, 1, 2, 3, 4, 30]
    assert meta.query_start_loc.tolist() == [0, 4, 9, 10]
    assert logits_indices.tolist() == [0, 1, 2, 3, 8, 9]  # r0's 3 drafts + bonus, r1, r2
    assert spec.target_logits_indices.tolist() == [0, 1, 2]
    assert spec.bonus_logits_indices.tolist() == [3, 4, 5]
    assert spec.draft_token_ids.tolist() == [11, 12, 13]
    assert spec.num_draft_tokens.tolist() == [3, 0, 0]
    # Optimistic: r0's sequence counted as if all 3 drafts will be accepted.
    assert meta.seq_lens.tolist() == [24, 5, 31]
    assert discard.tolist() == [False, True, False]
    # The drafts sit past r0's tokens without being counted as its tokens.
    assert runner.input_batch.num_tokens_np[0] == 21


def test_step_with_drafts_returns_kept_tokens_and_advances_the_batch(llama_worker):
    runner = llama_worker.runner
    batch = runner.input_batch
    run_step(runner, step(new=[new_req("a", prompt(20), [1, 2], 0, 20)]))
    first = runner.requests["a"].output_token_ids[-1]
    assert runner.execute_model(with_drafts(step(cached=[("a", [], 20, 3)]), {"a": [7, 8]})) is None
    assert runner.execute_model_state.logits.shape[0] == 3  # two drafts and a bonus row
    out = runner.sample_tokens(None)
    kept = list(out.sampled_token_ids[0].ids)
    assert 1 <= len(kept) <= 3 and kept[: len(kept) - 1] == [7, 8][: len(kept) - 1]
    assert runner.requests["a"].output_token_ids == [first, *kept]
    assert batch.num_tokens_np[0] == 21 + len(kept)
    assert batch.token_ids_np[0, 20 : 21 + len(kept)].tolist() == [first, *kept]


def drive(path, prompts, max_tokens, sampling, propose=None, chunk=8):
    """Chunked prefill then decode, half the requests joining three steps in."""
    worker = tiny_worker(path)
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=chunk)
    driver.propose = propose
    ids = list(prompts)
    for r in ids[: len(ids) // 2]:
        driver.add(r, prompts[r], max_tokens, sampling)
    for _ in range(3):
        driver.step()
    for r in ids[len(ids) // 2 :]:
        driver.add(r, prompts[r], max_tokens, sampling)
    return driver.run(), driver


PROMPTS = {
    "a": [(7 * i + 3) % 500 for i in range(23)],
    "b": [(11 * i + 1) % 500 for i in range(5)],
    "c": [(13 * i + 2) % 500 for i in range(41)],
    "d": [(17 * i + 9) % 500 for i in range(16)],
}


def oracle(expected: dict[str, list[int]], wrong_at: int | None = None):
    """Drafts from a run without speculation: the request's own continuation, made wrong at
    draft `wrong_at` when given."""

    def propose(req: DriverRequest) -> list[int]:
        drafts = list(expected[req.req_id][len(req.output) : len(req.output) + K])
        if wrong_at is not None and wrong_at < len(drafts):
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 512
        return drafts

    return propose


def no_eos(sampling: pb.RequestSamplingParams, max_tokens: int) -> pb.RequestSamplingParams:
    sampling.min_tokens = max_tokens
    sampling.stop_token_ids.append(2)
    return sampling


@pytest.mark.parametrize("wrong_at", [None, 0, 1])
def test_greedy_tokens_are_the_same_with_drafts(tiny_checkpoints, wrong_at):
    sampling = no_eos(greedy(), 14)
    expected, _ = drive(tiny_checkpoints["llama"], PROMPTS, 14, sampling)
    ours, driver = drive(
        tiny_checkpoints["llama"], PROMPTS, 14, sampling, oracle(expected, wrong_at)
    )
    assert ours == expected
    assert driver.num_drafted > 0
    # Right drafts are all accepted; a wrong one stops acceptance there.
    accepted_share = {None: 1.0, 0: 0.0}
    if wrong_at in accepted_share:
        assert driver.num_accepted == accepted_share[wrong_at] * driver.num_drafted
    else:
        assert 0 < driver.num_accepted < driver.num_drafted


SEEDED = pb.RequestSamplingParams(
    temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=77, frequency_penalty=0.6,
    presence_penalty=0.4, repetition_penalty=1.3, min_tokens=6, stop_token_ids=[2, 5], logprobs=2,
)  # fmt: skip


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_seeded_sampling_with_penalties_is_the_same_with_drafts(tiny_checkpoints, wrong_at):
    """Seeds, penalties, min_tokens and top-k/top-p/min-p: each verified position is sampled as
    its plain step would have been, so the tokens (and logprobs) are the same."""
    path = tiny_checkpoints["llama"]
    expected, _ = drive(path, {"s": prompt(19, 5)}, 16, SEEDED, chunk=6)
    ours, driver = drive(path, {"s": prompt(19, 5)}, 16, SEEDED, oracle(expected, wrong_at), 6)
    assert ours == expected
    assert driver.num_drafted > 0 and (driver.num_accepted > 0 or wrong_at is not None)


def logprobs_by_token(path, drafts_from=None):
    """[(token, rank, top ids, logprobs)] per output token of one seeded request."""
    worker = tiny_worker(path)
    driver = StepDriver(worker.runner, worker.num_blocks, 16)
    driver.propose = drafts_from
    driver.add("s", prompt(19, 5), 10, SEEDED)
    rows = []
    while driver.active:
        out = driver.step()
        entries = [list(e.positions) for e in out.token_logprobs] or [[e] for e in out.logprobs]
        for lp in entries[0]:
            rows.append((lp.token_ids[0], lp.sampled_token_rank, list(lp.token_ids), lp.logprobs))
    return rows, driver.results["s"]


def test_logprobs_one_entry_per_kept_token(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain, tokens = logprobs_by_token(path)
    spec, spec_tokens = logprobs_by_token(path, oracle({"s": tokens}))
    assert spec_tokens == tokens and len(spec) == len(plain) == len(tokens)
    for (t, rank, ids, values), (t2, rank2, ids2, values2) in zip(plain, spec, strict=True):
        assert (t, rank, ids) == (t2, rank2, ids2)
        np.testing.assert_allclose(values, values2, atol=1e-4)


def test_default_model_greedy_with_ngram_drafts(
    default_worker, default_tokenizer, hf_default_model
):
    """The real model in float32 on a prompt that repeats itself: the n-gram proposer's drafts
    are mostly accepted and the tokens are those of plain decoding, and of transformers."""
    text = "Copy the list exactly.\nList: red, green, blue, yellow, purple, orange.\nCopy: red,"
    ids = default_tokenizer(text)["input_ids"]
    sampling = no_eos(greedy(), 12)
    proposer = NgramProposer(4, min_n=1, max_n=3)
    results = []
    for propose in (None, lambda req: proposer.propose(req.prompt + req.output).tolist()):
        default_worker.reset()
        driver = StepDriver(default_worker.runner, default_worker.num_blocks, 16)
        driver.propose = propose
        driver.add("p", ids, 12, sampling)
        results.append(driver.run()["p"])
    text = default_tokenizer.decode(results[0])
    print(f"{driver.num_accepted} of {driver.num_drafted} drafts accepted: {text!r}")
    assert results[0] == results[1], text
    assert driver.num_drafted >= 6 and driver.num_accepted >= 0.75 * driver.num_drafted
    note = assert_greedy_parity(
        hf_default_model, ids, results[1], hf_greedy(hf_default_model, ids, 12)
    )
    assert note is None, note


def two_running(runner):
    """a and b prefilled (8 prompt tokens + 1 sampled each; 8 computed)."""
    run_step(
        runner, step(new=[new_req("a", prompt(8), [1], 0, 8), new_req("b", prompt(8), [2], 0, 8)])
    )


CONSTRAINED = pb.RequestSamplingParams(temperature=0.0, top_p=1.0, json_object=True)
BAD_DRAFTS = {
    "draft outside the vocabulary": lambda: with_drafts(
        step(cached=[("a", [], 8, 2)]), {"a": [100_000]}
    ),
    "more drafts than scheduled tokens": lambda: with_drafts(
        step(cached=[("a", [], 8, 2)]), {"a": [1, 2]}
    ),
    "fewer drafts than scheduled tokens": lambda: with_drafts(
        step(cached=[("a", [], 8, 3)]), {"a": [1]}
    ),
    "drafts for a request mid-prefill": lambda: with_drafts(
        step(new=[new_req("n", prompt(12), [3], 0, 8)]), {"n": [1]}
    ),
    "drafts for a running request behind on its tokens": lambda: with_drafts(
        step(cached=[("a", [], 4, 2)]), {"a": [1]}
    ),
    "drafts for an unknown request": lambda: with_drafts(
        step(cached=[("a", [], 8, 1)]), {"zzz": [1]}
    ),
    "drafts for a request not scheduled": lambda: with_drafts(
        step(cached=[("a", [], 8, 1)]), {"b": [1]}
    ),
    "duplicate draft entries": lambda: with_drafts(
        with_drafts(step(cached=[("a", [], 8, 2)]), {"a": [1]}), {"a": [1]}
    ),
    "empty draft entry": lambda: with_drafts(step(cached=[("a", [], 8, 1)]), {"a": []}),
    "drafts for a constrained request": lambda: with_drafts(
        step(new=[new_req("n", prompt(8), [3], 7, 2, CONSTRAINED)]), {"n": [1]}
    ),
    "drafts past max_model_len": lambda: with_drafts(
        step(new=[new_req("n", prompt(1022), list(range(3, 67)), 1021, 3)]), {"n": [1, 2]}
    ),
}


def snapshot(runner):
    batch = runner.input_batch
    return (
        dict(batch.req_id_to_index),
        {k: (list(v.block_ids), v.num_computed_tokens, list(v.output_token_ids))
         for k, v in runner.requests.items()},
        [batch.token_ids_np.copy(), batch.num_tokens_np.copy(),
         batch.num_computed_tokens_np.copy(), batch.block_table.table_np.copy()],
    )  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DRAFTS))
def test_bad_draft_field_is_refused_and_changes_nothing(llama_worker, case):
    runner = llama_worker.runner
    two_running(runner)
    before = snapshot(runner)
    with pytest.raises(InvalidStepError, match="draft"):
        runner.execute_model(BAD_DRAFTS[case]())
    after = snapshot(runner)
    assert before[:2] == after[:2]
    for x, y in zip(before[2], after[2], strict=True):
        np.testing.assert_array_equal(x, y)
    assert runner.execute_model_state is None
    # And the worker carries on, drafts and all.
    out = run_step(runner, with_drafts(step(cached=[("a", [], 8, 2), ("b", [], 8, 1)]), {"a": [9]}))
    assert [len(t.ids) for t in out.sampled_token_ids][1] == 1
    assert 1 <= len(out.sampled_token_ids[0].ids) <= 2


def test_grammar_mask_in_a_step_with_drafts(llama_worker):
    """An undrafted constrained request's mask lands on its own (bonus) row; a mask for a
    drafted request is refused with the logits still parked."""
    runner = llama_worker.runner
    vocab = runner.vocab_size
    allowed = 123
    words = np.zeros((1, -(-vocab // 32)), dtype="<i4")
    words[0, allowed // 32] = 1 << (allowed % 32)
    mask = pb.GrammarOutput(req_ids=["b"], bitmask=words.tobytes())
    outputs = []
    for grammar in (None, mask):
        runner.reset()
        two_running(runner)
        so = with_drafts(step(cached=[("a", [], 8, 3), ("b", [], 8, 1)]), {"a": [4, 5]})
        assert runner.execute_model(so) is None
        if grammar is not None:
            with pytest.raises(InvalidStepError, match="draft"):
                runner.sample_tokens(pb.GrammarOutput(req_ids=["a"], bitmask=words.tobytes()))
        outputs.append([list(t.ids) for t in runner.sample_tokens(grammar).sampled_token_ids])
    free, masked = outputs
    assert masked[1] == [allowed] and free[1] != [allowed]
    assert masked[0] == free[0]  # the drafted request's rows were left alone


TP_PROMPTS = {"g": [(i * 5) % 40 for i in range(30)], "s": prompt(19, 5)}


def drive_tp_prompts(worker, propose=None):
    """A greedy and a seeded request; the drafts come from `propose`."""
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=16)
    driver.propose = propose
    driver.add("g", TP_PROMPTS["g"], 16, no_eos(greedy(), 16))
    driver.add("s", TP_PROMPTS["s"], 16, SEEDED)
    return driver.run(), driver


def run_rank_with_drafts(model, rank, size, init_method, expected, results):
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.runner.worker import Worker

    worker = Worker(WorkerConfig(
        model=model, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_reqs=8,
        max_model_len=256, max_num_batched_tokens=256, tensor_parallel_size=size, rank=rank,
        distributed_init_method=init_method,
    ))  # fmt: skip
    out, driver = drive_tp_prompts(worker, oracle(expected, wrong_at=2))
    results.put((rank, out, driver.num_drafted, driver.num_accepted))
    # Leave the group together (see test_pipeline_parallel.run_rank).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def test_tensor_parallel_ranks_verify_the_same_drafts(tiny_checkpoints):
    """TP=2 ranks, each given the same steps with drafts (right, then wrong at the third),
    keep the same tokens: those of TP=1 without drafts."""
    from tests.worker.test_tensor_parallel import free_port

    model = tiny_checkpoints["llama"]
    plain = tiny_worker(model, kv_cache_memory_bytes=16 << 20, max_num_reqs=8, max_model_len=256,
                        max_num_batched_tokens=256)  # fmt: skip
    expected, _ = drive_tp_prompts(plain)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=run_rank_with_drafts, args=(model, r, 2, init, expected, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    ranks = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert ranks[0][1:] == ranks[1][1:]  # same tokens and the same acceptance on both ranks
    assert ranks[0][1] == expected
    assert 0 < ranks[0][3] < ranks[0][2]  # drafts verified, some accepted, some not
