"""The engine loop over the in-process executor, with the fake worker."""

from __future__ import annotations

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.uni import UniProcExecutor

from .conftest import make_config, make_fake_engine, make_prompt
from .fake_worker import fake_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class CustomExecutor(UniProcExecutor):
    pass


def test_get_class_picks_uni_and_qualified_subclasses():
    assert Executor.get_class(make_config()) is UniProcExecutor
    name = f"{__name__}.CustomExecutor"
    assert Executor.get_class(make_config(executor_backend=name)) is CustomExecutor
    assert Executor.get_class(make_config(executor_backend=CustomExecutor)) is CustomExecutor


@pytest.mark.parametrize("backend, error", [
    ("nope", ValueError),
    ("collections.OrderedDict", TypeError),  # exists, but is no Executor
    ("no_such_pkg.Executor", ValueError),
    (dict, TypeError),
])
def test_get_class_refuses_what_is_not_an_executor(backend, error):
    with pytest.raises(error, match="executor_backend"):
        Executor.get_class(SchedulerConfig(executor_backend=backend))


@pytest.mark.parametrize("backend", ["grpc", "zmq"])
def test_remote_backends_resolve_to_their_transport(backend):
    cls = Executor.get_class(make_config(executor_backend=backend))
    assert issubclass(cls, Executor) and cls.transport == backend


def test_uni_futures_are_resolved_and_carry_worker_exceptions():
    class Boom:
        def execute_model(self, so):
            raise RuntimeError("worker fell over")

        def get_info(self):
            return "info"

    executor = UniProcExecutor(make_config(), Boom())
    future = executor.execute_model(None, non_block=True)
    assert future.done()
    with pytest.raises(RuntimeError, match="fell over"):
        future.result()
    assert executor.collective_rpc("get_info") == ["info"]
    assert executor.collective_rpc("get_info", unique_reply_rank=0) == "info"


def test_engine_generates_what_the_model_gives_alone():
    engine, _ = make_fake_engine(64, 4, max_model_len=64)
    prompts = [make_prompt(n, 3 * n) for n in (5, 12, 3)]
    prompts = [[t % 64 for t in p] for p in prompts]
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    tokens = {r.request_id: [] for r in reqs}
    while engine.has_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[r.request_id] for r in reqs] == [fake_greedy(p, 8, 64) for p in prompts]


def test_abort_frees_blocks_at_once_and_the_worker_hears_next_step():
    engine, worker = make_fake_engine(32, 4, max_model_len=64)
    kv = engine.scheduler.kv
    a = engine.add_request([3] * 10, GREEDY, request_id="a")
    engine.add_request([4] * 6, GREEDY, request_id="b")
    engine.step()
    free_before = kv.num_free_blocks
    outs = engine.abort_requests(["a"])
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert kv.num_free_blocks == free_before + 3  # a's blocks, before any further step
    assert a.wire_id in worker.requests
    engine.step()
    assert list(worker.seen_outputs[-1].finished_req_ids) == [a.wire_id]
    assert a.wire_id not in worker.requests


def test_abort_of_the_last_request_still_reaches_the_worker():
    engine, worker = make_fake_engine(32, 4, max_model_len=64)
    a = engine.add_request([3] * 5, GREEDY, request_id="a")
    engine.step()
    engine.abort_requests(["a"])
    assert engine.has_requests()  # a zero-token step is owed to the worker
    assert engine.step() == []
    assert worker.seen_outputs[-1].total_num_scheduled_tokens == 0
    assert a.wire_id not in worker.requests and not engine.has_requests()


def test_abort_of_a_waiting_request_never_reaches_the_worker():
    engine, worker = make_fake_engine(32, 4, max_model_len=64, max_num_seqs=1,
                                      max_num_batched_tokens=64)
    engine.add_request([3] * 5, GREEDY, request_id="a")
    engine.add_request([4] * 5, GREEDY, request_id="b")
    engine.step()
    engine.abort_requests(["b", "unknown"])
    engine.step()
    assert len(worker.seen_outputs[-1].finished_req_ids) == 0


def test_a_256_request_decode_step_fits_in_4_kib():
    engine, _ = make_fake_engine(2000, 16, max_num_seqs=256, max_num_batched_tokens=8192,
                                 max_model_len=256)
    engine.scheduler._next_id = 1000  # as after 1,000 earlier requests: two-digit wire ids
    for _ in range(256):
        engine.add_request([5] * 20, SamplingParams(temperature=0, max_tokens=100))
    engine.step()
    so = engine.scheduler.schedule()
    assert len(so.scheduled_cached_reqs.req_ids) == 256
    assert so.ByteSize() < 4096, so.ByteSize()
