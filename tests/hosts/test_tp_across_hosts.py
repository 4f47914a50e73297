"""A tensor-parallel group of two ranks on two test hosts (`--rank` with the rendezvous on rank
0's host, gloo across the link), driven by an engine on a third: greedy tokens equal the
in-process engine's."""

from __future__ import annotations

import json
import sys

from tests.deploy.processes import REPO

from .cluster import HostProcess
from .conftest import network
from .test_across_hosts import REQUESTS, reference

WORKER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "8M", "--block-size", "16",
               "--max-num-reqs", "16", "--max-model-len", "512", "--max-num-batched-tokens", "512")


def test_a_tp_group_with_its_ranks_on_two_hosts(tiny_llama, tmp_path):
    with network(3) as net:
        engine_host, *rank_hosts = net.hosts
        rendezvous = f"tcp://{rank_hosts[0].address}:29500"
        ranks = []
        for rank, host in enumerate(rank_hosts):
            ready = tmp_path / f"rank{rank}.json"
            argv = [sys.executable, "-m", "worker_svc", "--model", tiny_llama, *WORKER_ARGS,
                    "--tensor-parallel-size", "2", "--rank", str(rank),
                    "--distributed-init-method", rendezvous, "--host", host.address,
                    "--port", "50061", "--zmq-port", "50062", "--metrics-port", "0",
                    "--ready-file", str(ready), "--log-level", "INFO"]
            ranks.append(HostProcess(host, f"rank{rank}", argv, tmp_path, ready,
                                     env={"GLOO_SOCKET_IFNAME": "eth0"}))
        expected = reference(tiny_llama, REQUESTS)  # while the ranks load
        for process in ranks:
            process.wait_ready()
        spec = dict(model=tiny_llama, transport="zmq", requests=REQUESTS,
                    group=",".join(f"{h.address}:50062" for h in rank_hosts))
        out = engine_host.run([sys.executable, "-m", "tests.hosts.engine_script",
                               json.dumps(spec)], timeout_s=120, cwd=REPO)
        assert json.loads(out.stdout.splitlines()[-1]) == expected
