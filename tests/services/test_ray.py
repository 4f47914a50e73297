"""The ray transport on a local multi-node Ray cluster (a head without CPUs and two nodes of one
CPU, on loopback addresses): two replicas placed on different nodes, their tokens equal to the
in-process engine's (greedy and seeded); a node removed without grace mid-stream (every request
finishes once, with the undisturbed tokens); the replica back once a node joins; no worker
process left; `batchwire serve --transport ray` end to end. One cluster for the module: starting
one takes seconds."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import pytest
import ray
from batchwire.v1 import generate_pb2

from scheduler_svc.cli.commands import main as cli_main
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.engine.replicas import ReplicatedEngine
from scheduler_svc.executors.errors import WorkerUnavailableError
from scheduler_svc.executors.ray_group import connect_ray
from scheduler_svc.executors.ray_replicas import RayReplicas
from tests.client_api.server_process import ServerProcess, collect

from .conftest import scheduler_config
from .test_replicas import NUM_REQUESTS, WORKLOAD, Streams, greedy, mixed, reference  # noqa: F401

_NODE = dict(num_cpus=1, object_store_memory=80 << 20)
_RAY_ENV = dict(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")


@pytest.fixture(scope="module")
def cluster():
    """A head on 127.0.0.2 (no CPU: it runs no worker) and nodes on 127.0.0.3 and .4. Ray
    rewrites 127.0.0.1, hence the other loopback addresses. Ended by its own shutdown only:
    `ray stop` kills by process name, other Ray users' processes too."""
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp(prefix="bw-ray-", dir="/tmp")  # short: Ray's socket paths
    saved = {k: os.environ.get(k) for k in (*_RAY_ENV, "RAY_TMPDIR", "HOME")}
    os.environ.update(_RAY_ENV, RAY_TMPDIR=folder, HOME=folder)
    started = time.monotonic()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, node_ip_address="127.0.0.2", object_store_memory=80 << 20,
        include_dashboard=False))
    try:
        nodes = [c.add_node(node_ip_address=f"127.0.0.{i}", **_NODE) for i in (3, 4)]
        c.wait_for_nodes()
        print(f"Ray cluster of 3 nodes up in {time.monotonic() - started:.1f} s")
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


def ray_config(model: str, address: str, **overrides):
    return scheduler_config(model, "ray", ray_address=address, **overrides)


def gone(pid: int) -> bool:
    """True once the process is gone (or a zombie its parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def node_id_of(node) -> str:
    return node.node_id if hasattr(node, "node_id") else node.unique_id


def test_replicas_spread_survive_a_lost_node_and_come_back(cluster, tiny_llama,
                                                           reference):  # noqa: F811
    c, nodes = cluster
    config = ray_config(tiny_llama, c.address)
    supervisor = RayReplicas(config, 2)
    engine = ReplicatedEngine(config, list(supervisor.executors))
    supervisor.attach_to(engine)
    first = list(supervisor.executors)
    pids = [pid for e in first for pid in e.ray_group.pids]
    try:
        placed = [e.node_ids[0] for e in first]
        assert len(set(placed)) == 2, f"both replicas on node {placed[0]}"
        assert set(placed) == {node_id_of(n) for n in nodes}

        for i, (prompt, max_tokens) in enumerate(WORKLOAD):
            engine.add_request(prompt, mixed(i, max_tokens), request_id=f"r{i}")
        streams = Streams()
        streams.until_every_request_runs(engine)

        lost = first[1]
        lost_node = next(n for n in nodes if node_id_of(n) == lost.node_ids[0])
        c.remove_node(lost_node, allow_graceful=False)
        while engine.has_requests():
            streams.take(engine.step())
        assert engine.num_moved == NUM_REQUESTS // 2
        assert isinstance(lost._failure, WorkerUnavailableError)
        assert streams.tokens == reference  # no gap, no duplicate, the undisturbed tokens
        assert set(streams.finished.values()) == {"length"}
        assert streams.counts == {r: len(t) for r, t in reference.items()}

        # No room for it until a node joins: then the supervisor places it there. The new node
        # takes the lost one's address, so the cluster's live nodes keep one address each (the
        # next test tells nodes apart by their workers' addresses).
        added = c.add_node(node_ip_address=lost_node.node_ip_address, **_NODE)
        wait_until(lambda: engine.apply_commands() is not None and len(engine.replicas) == 2,
                   "the replica to come back")
        back = supervisor.executors[1]
        assert back is not None and back.node_ids == [node_id_of(added)]
        pids += back.ray_group.pids
        engine.add_request(WORKLOAD[0][0], greedy(WORKLOAD[0][1]), request_id="again-0")
        engine.add_request(WORKLOAD[2][0], greedy(WORKLOAD[2][1]), request_id="again-2")
        assert sorted(r.load for r in engine.replicas) == [1, 1]
        again = Streams()
        while engine.has_requests():
            again.take(engine.step())
        assert again.tokens == {"again-0": reference["r0"], "again-2": reference["r2"]}
    finally:
        supervisor.stop()
        engine.shutdown()
    wait_until(lambda: all(gone(pid) for pid in pids), "the worker processes to end", 30)


def run(core: EngineCore, prompts, params) -> dict[str, list[int]]:
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(prompt, p, request_id=f"q{i}")
        tokens: dict[str, list[int]] = {}
        while core.has_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens
    finally:
        core.shutdown()


def test_serve_over_ray_places_its_replicas_and_answers(cluster, tiny_llama_with_tokenizer,
                                                        tmp_path):
    """`batchwire serve --transport ray`: the server wiring, replicas placed, a request answered
    with the in-process engine's tokens, and every worker gone once the server stopped."""
    c, _ = cluster
    prompt = WORKLOAD[3][0]
    # ServerProcess's BASE_ARGS, in-process.
    expected = run(EngineCore(scheduler_config(
        tiny_llama_with_tokenizer, kv_cache_memory_bytes=64 << 20, max_model_len=256)),
        [prompt], [greedy(10)])["q0"]
    server = ServerProcess(tmp_path, "--model", tiny_llama_with_tokenizer, "--transport", "ray",
                           "--replicas", "2", "--ray-address", c.address, "--no-http")
    try:
        server.wait_serving()
        workers = server.server_info().workers
        assert [w.state for w in workers] == [generate_pb2.WORKER_STATE_READY] * 2
        live = [n for n in connect_ray(c.address).nodes()
                if n["Alive"] and n["Resources"].get("CPU")]
        assert len({n["NodeManagerAddress"] for n in live}) == len(live) == 2  # one address each
        assert len({w.address.rpartition(":")[0] for w in workers}) == 2  # two nodes
        ids, _, last, _ = collect(server.stub.Generate(generate_pb2.GenerateRequest(
            token_ids=prompt, sampling=generate_pb2.SamplingParams(
                temperature=0, max_tokens=10, ignore_eos=True))))
        assert ids == expected and last.finish_reason == "length"
    finally:
        server.stop()
    addresses = [w.address for w in workers]
    wait_until(lambda: not any(listening(a) for a in addresses), "the workers to stop", 30)


def test_a_tensor_parallel_group_spans_two_nodes_and_matches(cluster, tiny_llama):
    """P x T > 1 over Ray: a TP=2 group on nodes of one CPU each is placed across both (PACK
    spans nodes when no node holds the group), its ranks meet over gloo between the nodes'
    addresses, and its greedy tokens are the single in-process worker's."""
    c, _ = cluster
    prompts = [prompt for prompt, _ in WORKLOAD]
    params = [greedy(max_tokens) for _, max_tokens in WORKLOAD]
    expected = run(EngineCore(scheduler_config(tiny_llama)), prompts, params)
    core = EngineCore(ray_config(tiny_llama, c.address, tensor_parallel_size=2))
    executor = core.executor
    assert len(set(executor.node_ids)) == 2, executor.node_ids
    pids = list(executor.ray_group.pids)
    assert run(core, prompts, params) == expected  # run() shuts the engine down
    wait_until(lambda: all(gone(pid) for pid in pids), "the ranks to end", 30)


def listening(address: str) -> bool:
    import socket

    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def test_ray_transport_without_ray_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--transport", "ray", "--replicas", "2"])
    assert str(info.value) == ("batchwire serve: --transport ray needs Ray: "
                               "pip install 'batchwire[ray]'")
