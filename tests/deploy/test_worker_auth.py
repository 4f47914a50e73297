"""Who may drive a worker, and who may register one, through real processes on loopback.

One scheduler that requires mutual TLS and an API key on its client port, and one worker that
registers with it over that port (--scheduler-tls-*, --scheduler-api-key-file) and answers only
the shared worker token (--worker-token-file on both, set through the environment as the
manifests do), which registering presents too. Registration without the key, the token or the
certificate is refused; Worker calls without
the token or with another, over gRPC and ZMQ, get UNAUTHENTICATED and leave the batch as it was;
through it all the scheduler keeps serving Generate through that worker, which at last leaves it
(Deregister, with the key).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import grpc
import pytest
from batchwire.common.key_file import WorkerToken
from batchwire.common.tls import ClientTls, channel
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from batchwire.v1 import worker_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.errors import WorkerRefusedError
from scheduler_svc.executors.grpc_executor import GrpcExecutor
from scheduler_svc.executors.zmq_executor import ZmqExecutor
from tests.client_api.server_process import collect, greedy, text_request
from tests.services.conftest import WireClient
from tests.services.test_worker_protocol import decode_step, ok, prefill_step, run_decode, tokens_of
from worker_svc.server.registration import Registration, SchedulerLink

from .certs import make_ca, make_cert
from .processes import Process, worker

TOKEN = "worker-token-for-the-test"
API_KEY = "client-key-for-the-test"
SERVING = health_pb2.HealthCheckResponse.SERVING
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
LIMITS = ("--dtype", "float32", "--kv-cache-memory", "8M", "--block-size", "16",
          "--max-model-len", "512", "--max-num-batched-tokens", "512")
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("worker-auth")
    ca = make_ca()
    (d / "ca.crt").write_bytes(ca.cert)
    (d / "token").write_text(f"# the scheduler sends the first\n{TOKEN}\n")
    (d / "wrong-token").write_text("not-the-worker-token\n")
    (d / "api-keys").write_text(f"{API_KEY}\n")
    (d / "other-key").write_text("not-a-client-key\n")
    return {
        "dir": d, "ca": str(d / "ca.crt"), "token": str(d / "token"),
        "wrong_token": str(d / "wrong-token"), "api_keys": str(d / "api-keys"),
        "other_key": str(d / "other-key"),
        "server": make_cert(ca, "scheduler", ("localhost", "127.0.0.1")).write(d, "server"),
        # The registering worker and the test's own client: certificates the scheduler accepts.
        "client": make_cert(ca, "client", client=True, server=False).write(d, "client"),
    }


def wait_until(predicate, timeout_s: float, what: str, *processes: Process) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in processes:
            assert p.process.poll() is None, f"{p.cmd[2:4]} exited:\n{p.log()}"
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s:\n" + "\n".join(
            p.log() for p in processes)
        time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(files, tiny_llama_with_tokenizer):
    d, model = files["dir"], tiny_llama_with_tokenizer
    ready = d / "scheduler.ready.json"
    cert, key = files["server"]
    scheduler = Process(
        [sys.executable, "-m", "scheduler_svc.cli", "scheduler", "--model", model, *LIMITS,
         "--max-num-seqs", "16", "--transport", "zmq", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--no-http", "--ready-file", str(ready), "--no-progress",
         "--no-prefix-caching",
         "--log-level", "WARNING", "--tls-cert", cert, "--tls-key", key,
         "--tls-client-ca", files["ca"], "--api-key-file", files["api_keys"]],
        ready, d / "scheduler.log", env={**ENV, "BATCHWIRE_WORKER_TOKEN_FILE": files["token"]})
    processes = [scheduler]
    try:
        address = f"127.0.0.1:{scheduler.wait_ready()['port']}"
        client_cert, client_key = files["client"]
        registering = worker(
            d, "worker", "--model", model, *LIMITS, "--max-num-reqs", "16",
            "--log-level", "INFO", "--scheduler-address", address,
            "--scheduler-tls-ca", files["ca"], "--scheduler-tls-server-name", "localhost",
            "--scheduler-tls-cert", client_cert, "--scheduler-tls-key", client_key,
            env={**ENV, "BATCHWIRE_WORKER_TOKEN_FILE": files["token"],
                 "BATCHWIRE_SCHEDULER_API_KEY_FILE": files["api_keys"]})
        processes.append(registering)
        (rank,) = registering.wait_ready()["ranks"]
        tls = ClientTls.from_options(files["ca"], client_cert, client_key)
        ch = channel(address, tls)
        health = health_pb2_grpc.HealthStub(ch)

        def serving() -> bool:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING

        wait_until(serving, 120, "SERVING once the worker registered", *processes)
        deployment = {"address": address, "channel": ch, "rank": rank, "worker": registering}
        deployment["reference"] = generate(deployment)
        yield deployment
        ch.close()
    finally:
        for p in reversed(processes):
            p.stop(grace_s=0)  # graceful exits are tested elsewhere (and the worker's below)


def generate(deployment) -> list[int]:
    stub = generate_pb2_grpc.GenerationStub(deployment["channel"])
    request = text_request("Hello, world", greedy(6))
    ids, _, last, _ = collect(stub.Generate(request, timeout=60,
                                            metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert len(ids) == 6 and last.finish_reason == "length"
    return ids


def test_a_worker_registers_over_mutual_tls_with_a_key_and_serves(deployment):
    assert generate(deployment) == deployment["reference"]  # greedy: the same tokens again


def registration(deployment, files, *, tls: bool = True, cert: bool = True,
                 key_file: str | None = None, token: str | None = TOKEN) -> Registration:
    client = ClientTls.from_options(files["ca"], *(files["client"] if cert else (None, None)))
    link = SchedulerLink(deployment["address"], client if tls else None, key_file)
    rank = {"rank": 0, "grpc_port": 1, "zmq_port": 2}  # never dialled: refused before that
    return Registration(link, "127.0.0.1", "127.0.0.1", [rank], 1,
                        WorkerToken([token]) if token else None)


REFUSED_REGISTRATIONS = {  # who: (the API key file, the worker token, what the refusal names)
    "no key": (None, TOKEN, "missing API key"),
    "another key": ("other_key", TOKEN, "invalid API key"),
    # An API client is no worker: the scheduler has a worker token, and it is not presented.
    "a client key alone": ("api_keys", None, "missing worker token"),
    "another worker token": ("api_keys", "not-" + TOKEN, "invalid worker token"),
}


@pytest.mark.parametrize("who", [*REFUSED_REGISTRATIONS, "no client certificate", "plaintext"])
def test_registration_without_the_key_token_or_certificate_is_refused(deployment, files, who):
    key, token, named = REFUSED_REGISTRATIONS.get(who, ("api_keys", TOKEN, ""))
    reg = registration(deployment, files, key_file=files[key] if key else None, token=token,
                       cert=who != "no client certificate", tls=who != "plaintext")
    try:
        with pytest.raises(grpc.RpcError) as e:
            reg.register_once(timeout_s=10)
    finally:
        reg.channel.close()
    if who in REFUSED_REGISTRATIONS:
        assert e.value.code() == UNAUTHENTICATED, e.value
        assert named in (e.value.details() or ""), e.value
    else:  # the TLS handshake fails: no call reaches the registry
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


def prefill(client: WireClient) -> dict[str, list[int]]:
    ok(client.call("Reset", b""))
    ok(client.call("ExecuteModel", prefill_step().SerializeToString()))
    return tokens_of(pb.ModelRunnerOutput.FromString(ok(client.call("SampleTokens", b""))))


@pytest.mark.parametrize("transport", ["grpc", "zmq"])
def test_worker_calls_without_the_token_are_refused_and_the_batch_kept(deployment, transport):
    address = f"127.0.0.1:{deployment['rank'][f'{transport}_port']}"
    good = WireClient(transport, address, TOKEN)
    strangers = {"no token": WireClient(transport, address),
                 "wrong token": WireClient(transport, address, "not-" + TOKEN)}
    try:
        # The scheduler is idle between requests (and caches no prefix): a Reset loses it nothing.
        undisturbed = prefill(good)
        run_decode(good, undisturbed)
        tokens = prefill(good)
        calls = {"Shutdown": b"", "Reset": b"", "GetInfo": b"", "SampleTokens": b"",
                 "ExecuteModel": decode_step(1, 1).SerializeToString()}
        for who, client in strangers.items():
            for method, payload in calls.items():
                code, message = client.call(method, payload)
                assert code == UNAUTHENTICATED, (who, method, code, message)
                assert b"worker token" in message, message
        run_decode(good, tokens)  # nothing the strangers sent reached the batch
        assert tokens == undisturbed
        ok(good.call("Reset", b""))
    finally:
        for c in (good, *strangers.values()):
            c.close()
    assert deployment["worker"].process.poll() is None  # Shutdown was not obeyed
    with grpc.insecure_channel(f"127.0.0.1:{deployment['rank']['grpc_port']}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(  # probes need no token
            health_pb2.HealthCheckRequest(service="batchwire.v1.Worker"), timeout=10)
        assert reply.status == SERVING


@pytest.mark.parametrize("executor", [GrpcExecutor, ZmqExecutor])
def test_an_executor_gets_in_with_the_token_and_not_with_another(deployment, files, tiny_llama,
                                                                 executor):
    address = f"127.0.0.1:{deployment['rank'][f'{executor.transport}_port']}"

    def config(token_file: str) -> SchedulerConfig:
        return SchedulerConfig(
            model=tiny_llama, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_seqs=16,
            max_model_len=512, max_num_batched_tokens=512, executor_backend=executor.transport,
            worker_addresses=(address,), worker_heartbeat_s=0.5, worker_token_file=token_file)

    with pytest.raises(WorkerRefusedError, match="UNAUTHENTICATED.*invalid worker token"):
        executor(config(files["wrong_token"])).shutdown()
    admitted = executor(config(files["token"]))  # connects, GetInfo, Reset (the scheduler idles)
    try:
        assert admitted.get_info().vocab_size == 512
    finally:
        admitted.shutdown()  # leaves the worker running: this executor did not start it


def test_the_scheduler_still_serves_after_the_refusals(deployment):
    info = generate_pb2_grpc.GenerationStub(deployment["channel"]).GetServerInfo(
        generate_pb2.GetServerInfoRequest(), timeout=10,
        metadata=[("authorization", f"Bearer {API_KEY}")])
    assert [w.state for w in info.workers] == [generate_pb2.WORKER_STATE_READY]
    assert generate(deployment) == deployment["reference"]


def test_the_worker_leaves_with_its_key(deployment):
    """SIGTERM: Deregister, which the scheduler's API key guards too, goes through first."""
    registering = deployment["worker"]
    registering.signal(signal.SIGTERM)
    assert registering.process.wait(timeout=30) == 0
    assert "0 request(s) moved, 0 lost" in registering.log(), registering.log()


def test_a_rotated_token_file_is_read_again(tmp_path):
    """The scheduler sends the file's first token; a worker accepts every one listed."""
    path = tmp_path / "token"
    path.write_text("old\n")
    sender, checker = WorkerToken.from_file(str(path)), WorkerToken.from_file(str(path))
    sender.recheck_s = checker.recheck_s = 0.0  # look at the file every time (1 s in service)
    assert sender.current() == "old" and checker.check("old") and not checker.check("new")
    path.write_text("new\nold\n")
    os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime, however coarse the clock
    assert sender.current() == "new"
    assert checker.check("new") and checker.check(b"old") and not checker.check("")
    path.write_text("")  # emptied by mistake: the tokens read before still hold
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert sender.current() == "new" and checker.check("old")


@pytest.mark.parametrize("argv, error", [
    (["--worker-token-file", "/nonexistent/token"], "cannot read the worker token file"),
    (["--scheduler-address", "127.0.0.1:1", "--scheduler-api-key-file", "/nonexistent/keys"],
     "cannot read the scheduler API key file"),
    (["--scheduler-tls-ca", "ca.crt"], "need --scheduler-address"),
])
def test_worker_options_that_cannot_work_stop_it_at_start(argv, error):
    from worker_svc.__main__ import main

    with pytest.raises(SystemExit, match=error):
        main(["--no-metrics", "--port", "0", "--zmq-port", "0", *argv])


def test_scheduler_refuses_an_empty_worker_token_file(tmp_path):
    from scheduler_svc.cli.commands import main

    (tmp_path / "token").write_text("# no token yet\n")
    with pytest.raises(SystemExit, match="no worker token"):
        main(["scheduler", "--port", "0", "--no-http", "--no-metrics",
              "--worker-token-file", str(tmp_path / "token")])
