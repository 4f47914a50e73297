"""`python -m worker_svc --pipeline-parallel-size 2`: the launcher starts both stages, each on its
own ports; driven over gRPC and ZMQ like a scheduler would (every call to every rank at once, the
output rank's reply read) they give one worker's tokens; a killed stage stops the group."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from batchwire.common.worker_config import WorkerConfig
from batchwire.v1 import worker_pb2 as pb

from worker_svc.runner.worker import Worker

from .conftest import LIMITS, WireClient
from .test_worker_protocol import DECODE_STEPS, decode_step, prefill_step, tokens_of


def with_new_tokens(so: pb.SchedulerOutput, tokens: dict[str, list[int]]) -> pb.SchedulerOutput:
    """The first stage samples nothing: each decode step tells it the token sampled last."""
    for req_id in so.scheduled_cached_reqs.req_ids:
        so.cached_new_token_ids.add().ids.append(tokens[req_id][-1])
    return so


@pytest.fixture(scope="module")
def expected_tokens(tiny_llama) -> dict[str, list[int]]:
    worker = Worker(WorkerConfig(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=8 << 20,
                                 **LIMITS))
    assert worker.execute_model(prefill_step()) is None
    tokens = tokens_of(worker.sample_tokens(None))
    for i in range(1, DECODE_STEPS + 1):
        assert worker.execute_model(decode_step(i, i)) is None
        for req_id, new in tokens_of(worker.sample_tokens(None)).items():
            tokens[req_id] += new
    return tokens


class Group:
    def __init__(self, transport: str, worker) -> None:
        self.clients = [WireClient(transport, worker.address(transport, r)) for r in (0, 1)]
        self.pool = ThreadPoolExecutor(2)

    def call(self, method: str, payload: bytes) -> list[tuple[grpc.StatusCode, bytes]]:
        """To both ranks at once: the second stage waits for the first's hidden states."""
        return list(self.pool.map(lambda c: c.call(method, payload), self.clients))

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.clients:
            c.close()


def ok(replies: list[tuple[grpc.StatusCode, bytes]]) -> list[bytes]:
    for code, payload in replies:
        assert code == grpc.StatusCode.OK, payload.decode(errors="replace")
    return [payload for _, payload in replies]


@pytest.mark.parametrize("transport", ["grpc", "zmq"])
def test_two_stages_over_the_wire(start_worker, expected_tokens, transport):
    worker = start_worker("--pipeline-parallel-size", "2")
    assert [r["rank"] for r in worker.ranks] == [0, 1]
    group = Group(transport, worker)
    try:
        infos = [pb.WorkerInfo.FromString(p) for p in ok(group.call("GetInfo", b""))]
        assert [(i.rank, i.pp_rank, i.pipeline_parallel_size, i.output_rank) for i in infos] == [
            (0, 0, 2, 1), (1, 1, 2, 1),
        ]  # fmt: skip
        # Two layers split one each: the same KV budget holds as many blocks on both stages.
        assert infos[0].num_blocks == infos[1].num_blocks

        first, last = (pb.ExecuteModelResponse.FromString(p)
                       for p in ok(group.call("ExecuteModel", prefill_step().SerializeToString())))
        assert first.HasField("output") and not first.output.req_ids  # handed on, nothing parked
        assert not last.HasField("output")  # the output rank parked its logits
        first, last = (pb.ModelRunnerOutput.FromString(p)
                       for p in ok(group.call("SampleTokens", b"")))
        assert first == pb.ModelRunnerOutput()  # the no-parked-state branch
        tokens = tokens_of(last)
        for i in range(1, DECODE_STEPS + 1):
            so = with_new_tokens(decode_step(i, i), tokens)
            ok(group.call("ExecuteModel", so.SerializeToString()))
            _, last = (pb.ModelRunnerOutput.FromString(p)
                       for p in ok(group.call("SampleTokens", b"")))
            for req_id, new in tokens_of(last).items():
                tokens[req_id] += new
        assert tokens == expected_tokens
        # SampleTokens again: refused on the output rank only.
        (code0, _), (code1, _) = group.call("SampleTokens", b"")
        assert (code0, code1) == (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        group.close()

    # A dead stage: the launcher stops the other one and exits with an error, within seconds.
    worker.signal(signal.SIGKILL, rank=0)
    start = time.monotonic()
    assert worker.process.wait(timeout=30) != 0
    assert time.monotonic() - start < 15
