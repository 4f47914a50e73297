"""The services on separate network stacks: a scheduler, two registering workers and the client,
each on a test host of its own (tests/hosts/netns.py). Greedy tokens through the client API equal
the in-process engine's, with TLS everywhere (names that match the advertised addresses) and the
worker token."""

from __future__ import annotations

import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from tests.deploy.certs import make_ca, make_cert
from tests.services.conftest import scheduler_config

from .cluster import Client, start_scheduler, start_worker
from .conftest import network

REQUESTS = [dict(id=f"r{i}", prompt=[(17 * i + 3 * j) % 500 + 3 for j in range(4 + 9 * i)],
                 max_tokens=24 + 8 * i) for i in range(4)]


def reference(model: str, requests: list[dict]) -> dict[str, list[int]]:
    """Each request's greedy tokens from an undisturbed in-process engine."""
    engine = EngineCore(scheduler_config(model))
    for r in requests:
        engine.add_request(r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                       ignore_eos=True), request_id=r["id"])
    tokens: dict[str, list[int]] = {}
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.shutdown()
    return tokens


@pytest.fixture(scope="module")
def expected(tiny_llama_with_tokenizer) -> dict[str, list[int]]:
    return reference(tiny_llama_with_tokenizer, REQUESTS)


def test_greedy_tokens_across_four_hosts_with_tls_and_worker_token(
        tiny_llama_with_tokenizer, expected, tmp_path):
    model = tiny_llama_with_tokenizer
    with network(4) as net:
        sched_host, *worker_hosts, client_host = net.hosts
        ca = make_ca()
        ca_file = tmp_path / "ca.crt"
        ca_file.write_bytes(ca.cert)
        # Each certificate names its host's address, the one its peers dial: the scheduler's
        # serves clients and registrations and is presented to the workers (mutual TLS).
        scheduler_cert, scheduler_key = make_cert(
            ca, "scheduler", (sched_host.address,), client=True).write(tmp_path, "scheduler")
        token_file = tmp_path / "worker-token"
        token_file.write_text("across-hosts-token\n")
        scheduler = start_scheduler(
            sched_host, model, tmp_path, "--transport", "grpc", "--tls-cert", scheduler_cert,
            "--tls-key", scheduler_key, "--worker-tls-ca", str(ca_file), "--worker-tls-cert",
            scheduler_cert, "--worker-tls-key", scheduler_key, "--worker-token-file",
            str(token_file), "--worker-heartbeat-s", "0.5")
        address = f"{sched_host.address}:{scheduler.wait_ready()['port']}"
        workers = []
        for host in worker_hosts:
            cert, key = make_cert(ca, "worker", (host.address,)).write(tmp_path, host.address)
            workers.append(start_worker(
                host, model, tmp_path, address, "--tls-cert", cert, "--tls-key", key,
                "--tls-ca", str(ca_file), "--scheduler-tls-ca", str(ca_file),
                "--worker-token-file", str(token_file), "--no-zmq"))
        ports = [w.wait_ready()["ranks"][0]["grpc_port"] for w in workers]
        client = Client(client_host, address, tls_ca=str(ca_file))
        registered = client.wait_ready_workers(2, 60, scheduler)
        # The scheduler dials what the workers advertised: their hosts' addresses.
        assert sorted(registered) == sorted(f"{h.address}:{p}"
                                            for h, p in zip(worker_hosts, ports, strict=True))

        results = client.run(REQUESTS)
        assert {i: r["tokens"] for i, r in results.items()} == expected
        assert {r["finish_reason"] for r in results.values()} == {"length"}
