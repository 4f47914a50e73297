"""The services on separate network stacks: a scheduler, two registering workers and the client,
each on a test host of its own (tests/hosts/netns.py), with TLS everywhere (certificates that name
the advertised addresses) and the worker token. Greedy tokens through the client API equal the
in-process engine's; a worker's link cut under load stalls no stream of the other worker, its
own streams move and finish once with the same tokens, the cut worker frees its batch, and it is
back after the heal; the scheduler's own link down and up within the grace period: every request
finishes, unchanged."""

from __future__ import annotations

import datetime
import re
import statistics
import sys
import time

import pytest

from tests.deploy.certs import make_ca, make_cert
from tests.services.conftest import scheduler_config

from .cluster import Client, scheduler_address, start_scheduler, start_worker
from .conftest import network
from .engine_script import greedy_tokens

HEARTBEAT_S = 0.5  # a cut worker is declared failed after about three missed heartbeats
GRACE_S = 10.0  # requests that lost every worker wait this long for one (--worker-grace-s)
# A worker that hears nothing from its scheduler this long frees its batch: longer than the
# scheduler takes to declare it failed (3 heartbeats).
SCHEDULER_LOST_S = 2.0
FREED = "the batch freed, with its requests"  # the worker's log, then
REQUESTS = [dict(id=f"r{i}", prompt=[(17 * i + 3 * j) % 500 + 3 for j in range(4 + 9 * i)],
                 max_tokens=24 + 8 * i) for i in range(4)]


def reference(model: str, requests: list[dict]) -> dict[str, list[int]]:
    """Each request's greedy tokens from an undisturbed in-process engine."""
    return greedy_tokens(scheduler_config(model), requests)


class Cluster:
    def __init__(self, net, folder, model: str) -> None:
        self.net = net
        sched_host, *self.worker_hosts, client_host = net.hosts
        ca = make_ca()
        ca_file = folder / "ca.crt"
        ca_file.write_bytes(ca.cert)
        # Each certificate names its host's address, the one its peers dial: the scheduler's
        # serves clients and registrations and is presented to the workers (mutual TLS).
        cert, key = make_cert(ca, "scheduler", (sched_host.address,), client=True).write(
            folder, "scheduler")
        token_file = folder / "worker-token"
        token_file.write_text("across-hosts-token\n")
        self.scheduler = start_scheduler(
            sched_host, model, folder, "--transport", "grpc", "--tls-cert", cert, "--tls-key",
            key, "--worker-tls-ca", str(ca_file), "--worker-tls-cert", cert, "--worker-tls-key",
            key, "--worker-token-file", str(token_file), "--worker-heartbeat-s", str(HEARTBEAT_S),
            "--worker-grace-s", str(GRACE_S))
        address = scheduler_address(sched_host)
        self.workers = []
        for host in self.worker_hosts:
            cert, key = make_cert(ca, "worker", (host.address,)).write(folder, host.address)
            self.workers.append(start_worker(
                host, model, folder, address, "--tls-cert", cert, "--tls-key", key,
                "--tls-ca", str(ca_file), "--scheduler-tls-ca", str(ca_file),
                "--worker-token-file", str(token_file), "--no-zmq",
                "--scheduler-lost-s", str(SCHEDULER_LOST_S)))
        self.client = Client(client_host, address, tls_ca=str(ca_file))

    def wait_serving(self) -> list[str]:
        self.scheduler.wait_ready()
        for worker in self.workers:
            worker.wait_ready()
        return self.client.wait_ready_workers(2, 60, self.scheduler)

    def scheduled_tokens(self, worker: int) -> float:
        """The worker's count of tokens its forward passes computed (its /metrics), read from
        the client host across the bridge."""
        host, info = self.worker_hosts[worker], self.workers[worker].info
        url = f"http://{host.address}:{info['ranks'][0]['metrics_port']}/metrics"
        script = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
        text = self.client.host.run([sys.executable, "-c", script]).stdout
        (line,) = [x for x in text.splitlines()
                   if x.startswith("batchwire_worker_scheduled_tokens_total")]
        return float(line.split()[-1])


@pytest.fixture(scope="module")
def cluster(tiny_llama_with_tokenizer, tmp_path_factory):
    with network(4) as net:
        yield Cluster(net, tmp_path_factory.mktemp("across-hosts"), tiny_llama_with_tokenizer)


def test_greedy_tokens_across_four_hosts_with_tls_and_worker_token(
        cluster, tiny_llama_with_tokenizer):
    expected = reference(tiny_llama_with_tokenizer, REQUESTS)  # while the services start
    registered = cluster.wait_serving()
    # The scheduler dials what the workers advertised: their hosts' addresses.
    assert sorted(registered) == sorted(
        f"{h.address}:{w.info['ranks'][0]['grpc_port']}"
        for h, w in zip(cluster.worker_hosts, cluster.workers, strict=True))

    results = cluster.client.run(REQUESTS)
    assert {i: r["tokens"] for i, r in results.items()} == expected
    assert {r["finish_reason"] for r in results.values()} == {"length"}


STREAMS = [dict(id=f"s{i}", prompt=[(29 * i + 5 * j) % 500 + 3 for j in range(8)],
                max_tokens=200) for i in range(8)]
CUT_AFTER_TOKENS = 30  # each stream's own cadence before the cut, measured over this many


def logged_at(line: str) -> float:
    """The time a log line of the services was written (their logging's asctime, local time)."""
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_a_cut_worker_stalls_no_stream_of_the_other(cluster, tiny_llama_with_tokenizer):
    expected = reference(tiny_llama_with_tokenizer, STREAMS + REQUESTS[:2])
    cluster.wait_serving()
    client, cut_host, cut_worker = cluster.client, cluster.worker_hosts[0], cluster.workers[0]
    freed_before = cut_worker.log_text().count(FREED)  # idle since the last test: freed too
    process = client.start(STREAMS, ready_tokens=CUT_AFTER_TOKENS)  # 4 on each worker
    client.wait_streaming(process)
    cut_at, cut_wall = time.monotonic(), time.time()
    cut_host.cut()
    try:
        results = client.results(process)
        # Cut off, the worker gives up on its scheduler and frees the batch it was left with.
        deadline = time.monotonic() + 5 * SCHEDULER_LOST_S
        while cut_worker.log_text().count(FREED) == freed_before:
            assert time.monotonic() < deadline, f"the batch not freed:\n{cut_worker.log()}"
            time.sleep(0.05)
    finally:
        cut_host.restore()
    restored_at = time.monotonic()
    line = [x for x in cut_worker.log_text().splitlines() if FREED in x][-1]
    freed_after_s = logged_at(line) - cut_wall
    print(f"\nthe cut worker freed its batch {freed_after_s:.2f} s after the cut")
    assert SCHEDULER_LOST_S <= freed_after_s + 0.1  # its last call ended about at the cut

    # Every stream finished once, with the tokens of an undisturbed run: no gap, no duplicate.
    assert {i: r["tokens"] for i, r in results.items()} == {s["id"]: expected[s["id"]]
                                                            for s in STREAMS}
    assert {(r["finish_reason"], r["finishes"], r["error"]) for r in results.values()} == {
        ("length", 1, None)}

    # When the scheduler declared the cut worker failed and moved its requests: from then on the
    # other worker also recomputes the moved requests (their prompts and the tokens they had),
    # so its next step is longer than any before the cut. That is the load a move brings, not a
    # stall; the stall this test is about is the wait for the failure to be noticed.
    failed_line = [x for x in cluster.scheduler.log_text().splitlines()
                   if REPLICA_FAILED.search(x)][-1]
    failed_at = cut_at + logged_at(failed_line) - cut_wall
    figures = {}
    for stream_id, r in results.items():
        before = [t for t in r["times"] if t < cut_at]
        waiting = [before[-1], *(t for t in r["times"] if cut_at <= t <= failed_at)]
        after = [before[-1], *(t for t in r["times"] if t >= cut_at)]
        assert after[1:], f"{stream_id} finished before the cut: streams too short"
        usual = gaps(before)
        bar = 2 * statistics.median(usual) + max(usual)
        figures[stream_id] = (statistics.median(usual), max(usual),
                              sorted(gaps(waiting), reverse=True)[:2], bar, max(gaps(after)),
                              next(t for t, g in zip(after[1:], gaps(after), strict=True)
                                   if g == max(gaps(after))) - cut_at)
    # The cut worker's streams waited for its failure to be noticed (missed heartbeats), then
    # moved. The other worker's went on at their own pace while the cut one was waited for: until
    # the failure was declared, their gaps stayed within twice their usual (median) gap plus one
    # step (the longest each took before the cut), all but at most one: on 2 cores shared with
    # the suite's other test process, one gap in a second may be a preemption (a fresh-clone run
    # saw one 130 ms gap on all four at once, 0.4 s before the failure was declared). A stall
    # by the engine lasts the whole wait (1.2 s with the old lockstep engine): no gap of theirs,
    # the take-over step included, may come near the wait for a failure to be noticed.
    moved = {i for i, (*_, worst, _) in figures.items() if worst > 2 * HEARTBEAT_S}
    kept = {i for i, (_, _, waiting, bar, worst, _) in figures.items()
            if (len(waiting) < 2 or waiting[1] <= bar) and worst < HEARTBEAT_S / 2}
    report = "\n".join(
        f"{i}: median {m * 1e3:.1f} ms, longest before {lb * 1e3:.1f} ms, worst two until the "
        f"failure {[round(g * 1e3, 1) for g in wt]} ms (bar {b * 1e3:.1f}), worst after the cut "
        f"{w * 1e3:.1f} ms (ending {e:.2f} s after the cut)"
        for i, (m, lb, wt, b, w, e) in sorted(figures.items()))
    report += f"\nthe cut worker was declared failed {failed_at - cut_at:.2f} s after the cut"
    print(f"\n{report}")
    assert len(moved) == 4 and kept == set(results) - moved, report

    # The link back: the worker registers again and takes new requests.
    before_tokens = cluster.scheduled_tokens(0)
    client.wait_ready_workers(2, 30, cluster.scheduler)
    back_after_s = time.monotonic() - restored_at
    print(f"READY again {back_after_s:.2f} s after the link came back")
    results = client.run(REQUESTS[:2])  # one each: the least loaded worker takes the next one
    assert {i: r["tokens"] for i, r in results.items()} == {i: expected[i] for i in results}
    assert cluster.scheduled_tokens(0) > before_tokens


# What the scheduler logs when it takes out a failed replica (engine/replicas.py _remove).
REPLICA_FAILED = re.compile(r"replica \S+ failed: \d+ request")


def test_the_schedulers_link_down_and_up_within_the_grace_period(cluster,
                                                                  tiny_llama_with_tokenizer):
    streams = STREAMS[:4]
    expected = reference(tiny_llama_with_tokenizer, streams)
    cluster.wait_serving()
    client, scheduler = cluster.client, cluster.scheduler
    sched_host = scheduler.host
    failures = len(REPLICA_FAILED.findall(scheduler.log_text()))
    process = client.start(streams, ready_tokens=CUT_AFTER_TOKENS)
    client.wait_streaming(process)
    cut_at = time.monotonic()
    sched_host.cut()  # the scheduler loses its workers and its client at once
    try:
        deadline = cut_at + GRACE_S / 2
        while len(REPLICA_FAILED.findall(scheduler.log_text())) < failures + 2:
            assert time.monotonic() < deadline, f"both workers not failed:\n{scheduler.log()}"
            time.sleep(0.05)
        noticed_s = time.monotonic() - cut_at
    finally:
        sched_host.restore()
    restored_at = time.monotonic()
    results = client.results(process)
    longest_stall_s = max(max(gaps(r["times"])) for r in results.values())
    print(f"\nboth workers declared failed {noticed_s:.2f} s after the scheduler's link went "
          f"down; the longest stall a stream saw: {longest_stall_s:.2f} s")
    assert {i: r["tokens"] for i, r in results.items()} == expected
    assert {(r["finish_reason"], r["finishes"], r["error"]) for r in results.values()} == {
        ("length", 1, None)}
    assert all(max(r["times"]) > restored_at for r in results.values()), "no stream waited"
