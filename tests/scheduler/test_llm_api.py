"""The offline API's shape, on the fake worker (the real model is in test_e2e_default_model.py)."""

from __future__ import annotations

import pytest
from batchwire.v1 import worker_pb2

from scheduler_svc import LLM, InvalidRequestError, SamplingParams
from scheduler_svc.executors.uni import UniProcExecutor

from .conftest import ByteTokenizer, fake_output, make_config, make_prompt, make_scheduler
from .fake_worker import FakeWorker, fake_greedy


@pytest.fixture
def fake_llm():
    worker = FakeWorker(num_blocks=40, block_size=4, vocab_size=64, eos_token_ids=(1,),
                        max_model_len=64)
    executor = UniProcExecutor(make_config(), worker)
    letters = ByteTokenizer([bytes([65 + i % 26]) for i in range(63)])
    return LLM(executor=executor, tokenizer=letters, max_model_len=64, block_size=4)


def test_generate_returns_one_result_per_prompt_in_order(fake_llm):
    prompts = [[5, 6, 7], {"prompt_token_ids": [9, 9]}, [3] * 10]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 2)]
    outputs = fake_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [[5, 6, 7], [9, 9], [3] * 10]
    for o, p, n in zip(outputs, ([5, 6, 7], [9, 9], [3] * 10), (4, 6, 2), strict=True):
        assert o.token_ids == fake_greedy(p, n, 64)
        assert o.finish_reason == "length" and o.stop_reason is None
        assert o.text == fake_llm.tokenizer.decode(o.token_ids)


def test_generate_reports_stop_token_reasons(fake_llm):
    prompt = next(p for p in ([5, 6, i] for i in range(2, 64)) if fake_greedy(p, 1, 64)[0] > 1)
    first = fake_greedy(prompt, 1, 64)[0]
    (out,) = fake_llm.generate([prompt], SamplingParams(temperature=0, stop_token_ids=[first]),
                               use_tqdm=False)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([first], "stop", first)


def test_a_bad_request_fails_the_call_and_leaves_nothing_behind(fake_llm):
    with pytest.raises(InvalidRequestError):
        fake_llm.generate([[5, 6], [5, 999]], SamplingParams(max_tokens=3), use_tqdm=False)
    scheduler = fake_llm.engine.scheduler
    assert not scheduler.requests and len(scheduler.waiting) == 0


def test_logprobs_are_passed_through():
    s = make_scheduler(max_logprobs=5)
    r = s.add_request(make_prompt(3), SamplingParams(max_tokens=2, logprobs=2))
    so = s.schedule()
    out = fake_output(s, so, 11)
    out.logprobs.add(token_ids=[11, 11, 4], logprobs=[-0.1, -0.1, -2.5], sampled_token_rank=1)
    (delta,) = s.update_from_output(so, out)
    assert delta.new_logprobs[0].token_ids == [11, 11, 4]
    assert delta.new_logprobs[0].sampled_token_rank == 1
    assert r.output_token_ids == [11]


def test_priority_policy_admits_lowest_value_then_earliest():
    s = make_scheduler(policy="priority", max_num_seqs=8, max_num_batched_tokens=64)
    order = [s.add_request(make_prompt(3, 10 * i), SamplingParams(), priority=p,
                           arrival_time=float(i)) for i, p in enumerate((2, 0, 1, 0))]
    so = s.schedule()
    wanted = [order[1], order[3], order[2], order[0]]
    assert [n.req_id for n in so.scheduled_new_reqs] == [r.wire_id for r in wanted]
    assert isinstance(so, worker_pb2.SchedulerOutput)
