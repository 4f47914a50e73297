"""A real worker with mutual TLS: the scheduler's executor gets in with its certificate, a
client without one does not; probes get health, and nothing else, on the plaintext port."""

from __future__ import annotations

import grpc
import pytest
from batchwire.common.tls import ClientTls
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.executors.grpc_executor import GrpcExecutor

from .certs import make_ca, make_cert
from .processes import worker

WORKER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "8M", "--block-size", "16",
               "--max-num-reqs", "16", "--max-model-len", "512", "--max-num-batched-tokens", "512",
               "--log-level", "WARNING")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(), make_ca("other")
    (d / "ca.crt").write_bytes(ca.cert)
    return {
        "dir": d, "ca": str(d / "ca.crt"),
        "worker": make_cert(ca, "worker", ("batchwire-worker",)).write(d, "worker"),
        "scheduler": make_cert(ca, "scheduler", client=True, server=False).write(d, "scheduler"),
        "impostor": make_cert(other, "x", client=True, server=False).write(d, "impostor"),
    }


@pytest.fixture(scope="module")
def tls_worker(tiny_llama, pki, tmp_path_factory):
    cert, key = pki["worker"]
    # Through the environment, as the manifests set them.
    env = {"BATCHWIRE_TLS_CERT": cert, "BATCHWIRE_TLS_KEY": key, "BATCHWIRE_TLS_CA": pki["ca"],
           "BATCHWIRE_HEALTH_PORT": "0", "BATCHWIRE_NO_ZMQ": "1"}
    process = worker(tmp_path_factory.mktemp("tls-worker"), "w", "--model", tiny_llama,
                     *WORKER_ARGS, env=env)
    try:
        (rank,) = process.wait_ready()["ranks"]
        yield rank
    finally:
        process.stop()


def config(tiny_llama: str, address: str, tls: ClientTls | None,
           heartbeat_s: float = 0.5) -> SchedulerConfig:
    return SchedulerConfig(model=tiny_llama, dtype="float32", kv_cache_memory_bytes=8 << 20,
                           max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512,
                           executor_backend="grpc", worker_addresses=(address,),
                           worker_heartbeat_s=heartbeat_s, worker_tls=tls)


def test_scheduler_reaches_a_worker_over_mutual_tls(tls_worker, tiny_llama, pki):
    address = f"127.0.0.1:{tls_worker['grpc_port']}"
    tls = ClientTls.from_options(pki["ca"], *pki["scheduler"], server_name="batchwire-worker")
    executor = GrpcExecutor(config(tiny_llama, address, tls))
    try:
        assert executor.get_info().vocab_size == 512
    finally:
        executor.shutdown()


@pytest.mark.parametrize("who", ["no certificate", "another CA", "plaintext"])
def test_worker_refuses_clients_without_a_good_certificate(tls_worker, tiny_llama, pki, who):
    address = f"127.0.0.1:{tls_worker['grpc_port']}"
    tls = {
        "no certificate": ClientTls.from_options(pki["ca"], server_name="batchwire-worker"),
        "another CA": ClientTls.from_options(pki["ca"], *pki["impostor"],
                                             server_name="batchwire-worker"),
        "plaintext": None,
    }[who]
    with pytest.raises(WorkerUnavailableError):
        # A refused handshake looks like a worker that cannot be reached: given up on after
        # ten heartbeats.
        GrpcExecutor(config(tiny_llama, address, tls, heartbeat_s=0.1)).shutdown()


def test_plaintext_port_serves_health_and_nothing_else(tls_worker):
    assert tls_worker["zmq_port"] == 0  # --no-zmq: ZMQ has no TLS
    with grpc.insecure_channel(f"127.0.0.1:{tls_worker['health_port']}") as ch:
        for service in ("", "batchwire.v1.Worker"):
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/batchwire.v1.Worker/GetInfo")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_worker_tls_with_zmq_is_refused():
    with pytest.raises(ValueError, match="grpc transport"):
        SchedulerConfig(executor_backend="zmq", worker_tls=ClientTls(ca_file="ca.crt"))
