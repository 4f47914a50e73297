"""The Worker service on the wire, over gRPC and ZMQ alike: the two-call step, the refused double
ExecuteModel, the empty output of a zero-token step, malformed requests answered with an error
while the batch stays intact, health, reflection, and a clean SIGTERM."""

from __future__ import annotations

import signal

import grpc
import pytest
from batchwire.common.worker_config import WorkerConfig
from batchwire.v1 import worker_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from worker_svc.runner.worker import Worker

from .conftest import LIMITS, WireClient

PROMPTS = {"a": [11, 22, 33, 44, 55], "b": [7, 8, 9, 10, 11, 12, 13]}
BLOCKS = {"a": [1], "b": [2]}  # one block of 16 holds each request for the whole test
DECODE_STEPS = 4


def greedy() -> pb.RequestSamplingParams:
    return pb.RequestSamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def prefill_step() -> pb.SchedulerOutput:
    so = pb.SchedulerOutput(step_id=0)
    for req_id, prompt in PROMPTS.items():
        so.scheduled_new_reqs.add(req_id=req_id, prompt_token_ids=prompt, sampling=greedy(),
                                  block_ids=BLOCKS[req_id], num_scheduled_tokens=len(prompt))
        so.total_num_scheduled_tokens += len(prompt)
    return so


def decode_step(step_id: int, num_generated: int) -> pb.SchedulerOutput:
    """Every request computes its latest token; num_generated tokens are out so far."""
    so = pb.SchedulerOutput(step_id=step_id)
    cached = so.scheduled_cached_reqs
    for req_id, prompt in PROMPTS.items():
        cached.req_ids.append(req_id)
        cached.new_block_ids.add()
        cached.num_computed_tokens.append(len(prompt) + num_generated - 1)
        cached.num_scheduled_tokens.append(1)
        so.total_num_scheduled_tokens += 1
    return so


def tokens_of(out: pb.ModelRunnerOutput) -> dict[str, list[int]]:
    return {r: list(t.ids) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}


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


@pytest.fixture(params=["grpc", "zmq"])
def client(request, shared_worker):
    wire = WireClient(request.param, shared_worker.address(request.param))
    assert wire.call("Reset", b"")[0] == grpc.StatusCode.OK
    yield wire
    wire.close()


def ok(result: tuple[grpc.StatusCode, bytes]) -> bytes:
    code, payload = result
    assert code == grpc.StatusCode.OK, payload.decode(errors="replace")
    return payload


def run_decode(client: WireClient, tokens: dict[str, list[int]]) -> None:
    for i in range(1, DECODE_STEPS + 1):
        reply = pb.ExecuteModelResponse.FromString(
            ok(client.call("ExecuteModel", decode_step(i, i).SerializeToString())))
        assert not reply.HasField("output")
        for req_id, new in tokens_of(
                pb.ModelRunnerOutput.FromString(ok(client.call("SampleTokens", b"")))).items():
            tokens[req_id] += new


def test_two_call_protocol(client, expected_tokens):
    info = pb.WorkerInfo.FromString(ok(client.call("GetInfo", b"")))
    assert (info.vocab_size, info.block_size) == (512, 16)
    assert (info.rank, info.tensor_parallel_size) == (0, 1)
    prefill = prefill_step().SerializeToString()

    reply = pb.ExecuteModelResponse.FromString(ok(client.call("ExecuteModel", prefill)))
    assert not reply.HasField("output")  # the logits are parked: the *none*
    code, message = client.call("ExecuteModel", prefill)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, message
    assert b"SampleTokens" in message
    tokens = tokens_of(pb.ModelRunnerOutput.FromString(ok(client.call("SampleTokens", b""))))
    assert {r: len(t) for r, t in tokens.items()} == {"a": 1, "b": 1}

    # A step that schedules no token answers at once with an empty output, and parks nothing.
    empty = pb.SchedulerOutput(step_id=99).SerializeToString()
    reply = pb.ExecuteModelResponse.FromString(ok(client.call("ExecuteModel", empty)))
    assert reply.HasField("output") and not reply.output.req_ids
    assert pb.ModelRunnerOutput.FromString(ok(client.call("SampleTokens", b""))).req_ids == []

    run_decode(client, tokens)
    assert tokens == expected_tokens


def truncated(message: pb.SchedulerOutput) -> bytes:
    """A prefix of the message that does not parse (cut inside a field, not between two)."""
    data = message.SerializeToString()
    for cut in range(len(data) // 2, len(data)):
        try:
            pb.SchedulerOutput.FromString(data[:cut])
        except Exception:
            return data[:cut]
    raise AssertionError("every prefix parses")


BAD_CALLS = {
    "garbage bytes": ("ExecuteModel", b"\xff\xfe\xfd garbage", grpc.StatusCode.INVALID_ARGUMENT),
    "garbage grammar": ("SampleTokens", b"\x00\x01\x02", grpc.StatusCode.INVALID_ARGUMENT),
    "unknown method": ("LaunchMissiles", b"", grpc.StatusCode.UNIMPLEMENTED),
    "truncated protobuf": ("ExecuteModel", truncated(decode_step(1, 1)),
                           grpc.StatusCode.INVALID_ARGUMENT),
}


def inconsistent_steps() -> dict[str, pb.SchedulerOutput]:
    wrong_total = decode_step(1, 1)
    wrong_total.total_num_scheduled_tokens = 5
    unknown = decode_step(1, 1)
    unknown.scheduled_cached_reqs.req_ids[0] = "nobody"
    bad_block = decode_step(1, 1)
    bad_block.scheduled_cached_reqs.new_block_ids[0].ids.append(10**6)
    ragged = decode_step(1, 1)
    del ragged.scheduled_cached_reqs.num_scheduled_tokens[1]
    return {"wrong total": wrong_total, "unknown request": unknown, "block out of range": bad_block,
            "ragged cached fields": ragged}


def test_malformed_requests_then_a_normal_step(client, expected_tokens):
    ok(client.call("ExecuteModel", prefill_step().SerializeToString()))
    tokens = tokens_of(pb.ModelRunnerOutput.FromString(ok(client.call("SampleTokens", b""))))

    for name, (method, payload, expected) in BAD_CALLS.items():
        code, message = client.call(method, payload)
        assert code == expected, f"{name}: {code} {message!r}"
    for name, so in inconsistent_steps().items():
        code, message = client.call("ExecuteModel", so.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {code} {message!r}"
    if client.transport == "zmq":
        for frames in ([b"ExecuteModel"], [b"ExecuteModel", b"", b"extra"], [b"", b"", b""]):
            code, _ = client.frames(frames)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, frames

    run_decode(client, tokens)  # the batch survived every refusal untouched
    assert tokens == expected_tokens


def test_health_and_reflection(shared_worker):
    with grpc.insecure_channel(shared_worker.address("grpc")) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "batchwire.v1.Worker"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        names = {s.name for s in response.list_services_response.service}
        assert {"batchwire.v1.Worker", "grpc.health.v1.Health"} <= names


def test_sigterm_shuts_down_cleanly(start_worker):
    worker = start_worker()
    worker.signal(signal.SIGTERM, rank=0)
    assert worker.process.wait(timeout=15) == 0


def test_worker_metrics_count_both_calls(start_worker):
    """/metrics (a free port here, 9091 by default) times ExecuteModel and SampleTokens."""
    import urllib.request

    worker = start_worker()
    port = worker.ranks[0]["metrics_port"]
    channel = grpc.insecure_channel(worker.address("grpc"))
    execute = channel.unary_unary("/batchwire.v1.Worker/ExecuteModel",
                                  pb.SchedulerOutput.SerializeToString,
                                  pb.ExecuteModelResponse.FromString)
    sample = channel.unary_unary("/batchwire.v1.Worker/SampleTokens",
                                 pb.GrammarOutput.SerializeToString,
                                 pb.ModelRunnerOutput.FromString)
    so = pb.SchedulerOutput(total_num_scheduled_tokens=4)
    so.scheduled_new_reqs.add(req_id="m", prompt_token_ids=[1, 2, 3, 4], block_ids=[1],
                              num_scheduled_tokens=4,
                              sampling=pb.RequestSamplingParams(top_p=1, repetition_penalty=1))
    assert not execute(so).HasField("output")
    assert len(sample(pb.GrammarOutput()).sampled_token_ids[0].ids) == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'batchwire_worker_execute_model_seconds_count{rank="0"} 1.0' in text
    assert 'batchwire_worker_sample_tokens_seconds_count{rank="0"} 1.0' in text
    assert 'batchwire_worker_scheduled_tokens_total{rank="0"} 4.0' in text
    channel.close()
