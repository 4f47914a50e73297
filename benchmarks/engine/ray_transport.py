"""`--transport ray` against `--transport zmq`: the same worker, started by a Ray actor on a node
of a local Ray cluster or by the scheduler itself, and driven over ZMQ either way. Measures the
cluster's start (a head and one node, on loopback addresses), each group's start, the time to
first token of one request on an idle engine, and the decode step time with 8 requests, the two
transports taking turns round by round. A tiny model: the transport's share is what shows.

    .venv/bin/python -m batchwire.benchmarks.engine.ray_transport --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.benchmarks.shared.tiny_model import tiny_model

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore

PROMPT = [(11 * j) % 500 + 3 for j in range(64)]


def _drain(core: EngineCore) -> None:
    while core.has_requests():
        core.step()


def one_round(config: SchedulerConfig, steps: int) -> dict[str, float]:
    started = time.perf_counter()
    core = EngineCore(config)
    start_s = time.perf_counter() - started
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        core.add_request(PROMPT, greedy, request_id="warm")
        _drain(core)
        t0 = time.perf_counter()
        core.add_request(PROMPT, greedy, request_id="ttft")
        while not any(o.new_token_ids for o in core.step()):
            pass
        ttft_s = time.perf_counter() - t0
        _drain(core)
        decode = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(8):
            core.add_request(PROMPT[: 8 + i], decode, request_id=f"d{i}")
        for _ in range(3):  # the prefills
            core.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        _drain(core)
    finally:
        core.shutdown()
    return {"group_start_s": start_s, "ttft_ms": ttft_s * 1e3,
            "step_ms": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bw-ray-bench-", dir="/tmp")
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=folder,
                      OMP_NUM_THREADS="1")
    import ray
    from ray.cluster_utils import Cluster

    model = tiny_model(os.path.join(folder, "tiny"), vocab_size=512)
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, node_ip_address="127.0.0.2", object_store_memory=80 << 20,
        include_dashboard=False))
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.3", object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        print(f"Ray cluster (head + 1 node) started in {time.perf_counter() - started:.1f} s")
        base = dict(model=model, dtype="float32", kv_cache_memory_bytes=16 << 20,
                    max_num_seqs=16, max_model_len=512)
        results: dict[str, list[dict[str, float]]] = {"zmq": [], "ray": []}
        for _ in range(args.rounds):
            for backend in ("zmq", "ray"):
                config = SchedulerConfig(executor_backend=backend, ray_address=cluster.address,
                                         **base)
                results[backend].append(one_round(config, args.steps))
        for key in ("group_start_s", "ttft_ms", "step_ms"):
            zmq_v = statistics.median(r[key] for r in results["zmq"])
            ray_v = statistics.median(r[key] for r in results["ray"])
            print(f"{key:14s} zmq {zmq_v:8.2f}  ray {ray_v:8.2f}  ray/zmq {ray_v / zmq_v:5.2f}")
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
