"""Pipeline-parallel worker groups driven by the real engine: PP=2 and PP=2 x TP=2 over ZMQ and
gRPC give an in-process worker's tokens through steps that mix prefills (chunked), decodes,
arrivals and finishes; killing one stage fails its group and a second replica finishes every
request with the undisturbed tokens."""

from __future__ import annotations

import signal
import time

import pytest

from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.replicas import ReplicatedEngine

from .conftest import WorkerProcess, scheduler_config
from .test_replicas import NUM_REQUESTS, WORKLOAD, Streams, mixed

# Half the requests arrive at step 0, the others at step 3 (joining running decodes); a chunk
# threshold of 24 splits the longer prompts over steps that also decode.
LATE = NUM_REQUESTS // 2
CHUNK = dict(long_prefill_token_threshold=24)


def run(engine: EngineCore) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and how many steps mixed a prefill with a decode."""
    tokens: dict[str, list[int]] = {}
    mixed_steps = 0
    step_no = 0
    while step_no <= 3 or engine.has_requests():
        if step_no in (0, 3):
            for i, (prompt, max_tokens) in enumerate(WORKLOAD):
                if (i < LATE) == (step_no == 0):
                    engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
        step = engine.launch_step()
        step_no += 1
        if step is None:
            continue
        cached = step.so.scheduled_cached_reqs
        if step.so.scheduled_new_reqs and 1 in cached.num_scheduled_tokens:
            mixed_steps += 1
        engine.sample_step(step)
        for out in engine.finish_step(step):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, mixed_steps


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    engine = EngineCore(scheduler_config(tiny_llama, **CHUNK))
    try:
        tokens, mixed_steps = run(engine)
    finally:
        engine.shutdown()
    assert mixed_steps > 0
    return tokens


def _group(tmp_path_factory, tiny_llama, *extra: str):
    worker = WorkerProcess(tiny_llama, tmp_path_factory.mktemp("pp"), *extra).wait_ready()
    yield worker
    worker.kill()


@pytest.fixture(scope="module")
def pp2(tmp_path_factory, tiny_llama):
    yield from _group(tmp_path_factory, tiny_llama, "--pipeline-parallel-size", "2")


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory, tiny_llama):
    yield from _group(tmp_path_factory, tiny_llama, "--pipeline-parallel-size", "2",
                      "--tensor-parallel-size", "2")


@pytest.mark.parametrize("backend", ["zmq", "grpc"])
@pytest.mark.parametrize("shape", ["pp2", "pp2_tp2"])
def test_pipeline_group_gives_one_workers_tokens(request, shape, backend, tiny_llama, reference):
    group = request.getfixturevalue(shape)
    config = scheduler_config(tiny_llama, backend, (group.group_address(backend),), **CHUNK)
    engine = EngineCore(config)
    try:
        infos = engine.executor.get_infos()
        assert engine.executor.output_rank == len(infos) - (2 if shape == "pp2_tp2" else 1)
        assert engine.info.num_blocks == min(i.num_blocks for i in infos)
        assert engine.scheduler.send_new_tokens
        tokens, mixed_steps = run(engine)
    finally:
        engine.shutdown()
    assert mixed_steps > 0
    assert tokens == reference


def test_killed_stage_fails_its_group_and_the_other_replica_finishes(pp2, tmp_path_factory,
                                                                     tiny_llama, reference):
    doomed = WorkerProcess(tiny_llama, tmp_path_factory.mktemp("pp-doomed"),
                           "--pipeline-parallel-size", "2").wait_ready()
    try:
        config = scheduler_config(tiny_llama, "zmq",
                                  (pp2.group_address("zmq"), doomed.group_address("zmq")))
        engine = ReplicatedEngine(config)
        try:
            for i, (prompt, max_tokens) in enumerate(WORKLOAD):
                engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
            streams = Streams()
            streams.until_every_request_runs(engine)
            doomed.signal(signal.SIGKILL, rank=0)  # the first stage: the output rank lives on
            start = time.monotonic()
            while len(engine.replicas) == 2:
                streams.take(engine.step())
                assert time.monotonic() - start < 10, "the dead stage was not noticed"
            assert engine.num_moved == NUM_REQUESTS // 2
            while engine.has_requests():
                streams.take(engine.step())
        finally:
            engine.shutdown()
        assert streams.tokens == reference
        assert set(streams.finished.values()) == {"length"}
    finally:
        doomed.kill()
