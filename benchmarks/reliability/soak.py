"""`batchwire bench soak --minutes N`: a mixed load on one `batchwire serve` process for N minutes,
sampling what would show a leak or a slow decay: the server's resident memory (its whole process
group), its open file descriptors, the KV blocks in use, and the latency of the requests that
finished in each window. Printed as it goes, then as a table and a chart.

The load: --concurrency streams at all times, each request one of greedy, seeded and
stop-string requests of mixed lengths, every fifth cancelled part-way. At the end the load
stops, and the KV blocks in use must go back to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time
from typing import Any

import grpc
import psutil
from batchwire.benchmarks.serving.latency import distribution
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report
from batchwire.benchmarks.shared.serve_process import ServeProcess
from batchwire.benchmarks.shared.workloads import HIGH_ID, LOW_ID
from batchwire.v1 import generate_pb2, generate_pb2_grpc

S = generate_pb2.SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight at all times")


def quick(args: argparse.Namespace) -> None:
    # 4.5 s of load sampled every second: four or five samples, enough for the first and last
    # thirds and for every kind of request (a cancelled one included) to have run.
    args.minutes, args.sample_s, args.concurrency = 0.075, 1.0, 4


@dataclasses.dataclass
class Window:
    """What finished between two samples."""
    e2e_s: list[float] = dataclasses.field(default_factory=list)
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    done: int = 0
    cancelled: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def request(rng: random.Random) -> tuple[generate_pb2.GenerateRequest, bool]:
    """A request of the mix, and whether the client cancels it part-way."""
    prompt = [rng.randrange(LOW_ID, HIGH_ID) for _ in range(rng.randint(8, 96))]
    kind = rng.randrange(3)
    if kind == 0:
        sampling = S(temperature=0, max_tokens=rng.randint(4, 48), ignore_eos=True)
    elif kind == 1:
        sampling = S(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=rng.randint(4, 48))
    else:
        sampling = S(temperature=0, max_tokens=rng.randint(4, 48), stop=[" the", "."])
    return generate_pb2.GenerateRequest(token_ids=prompt, sampling=sampling), rng.random() < 0.2


async def one(stub: Any, rng: random.Random, window: list[Window]) -> None:
    msg, cancel = request(rng)
    sent = time.perf_counter()
    first = None
    call = stub.Generate(msg, timeout=120)
    try:
        async for reply in call:
            if first is None and reply.token_ids:
                first = time.perf_counter()
                if cancel:
                    call.cancel()
                    window[0].cancelled += 1
                    return
        window[0].e2e_s.append(time.perf_counter() - sent)
        if first is not None:
            window[0].ttft_s.append(first - sent)
        window[0].done += 1
    except asyncio.CancelledError:
        raise
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            window[0].errors.append(f"{e.code().name}: {e.details()}")


def resources(server: ServeProcess) -> dict[str, float]:
    """RSS (MiB) and open file descriptors of the server and every process it started."""
    root = psutil.Process(server.process.pid)
    rss = fds = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.NoSuchProcess:
            pass
    return {"rss_mib": rss / (1 << 20), "fds": fds}


async def soak(server: ServeProcess, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    window = [Window()]  # the current one, swapped at each sample
    samples: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        end = time.perf_counter() + 60 * args.minutes
        start = time.perf_counter()

        async def stream_loop() -> None:
            while time.perf_counter() < end:
                await one(stub, rng, window)

        loops = [asyncio.create_task(stream_loop()) for _ in range(args.concurrency)]
        while time.perf_counter() < end:
            await asyncio.sleep(min(args.sample_s, max(end - time.perf_counter(), 0.05)))
            done, window[0] = window[0], Window()
            samples.append(await sample(stub, server, done, time.perf_counter() - start))
        await asyncio.gather(*loops)
        # Idle: every request ended, so every block must be free (cancelled ones included).
        for _ in range(50):
            last = await sample(stub, server, window[0], time.perf_counter() - start)
            if last["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.2)
        samples.append({**last, "idle": True})
    return samples


async def sample(stub: Any, server: ServeProcess, done: Window, t: float) -> dict[str, Any]:
    info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=30)
    row = {"t_s": t, **resources(server), "kv_blocks_used": info.kv_blocks_used,
           "kv_blocks_total": info.kv_blocks_total, "done": done.done,
           "cancelled": done.cancelled, "errors": done.errors,
           "e2e_ms": distribution(done.e2e_s), "ttft_ms": distribution(done.ttft_s)}
    print(f"  t={t:6.0f} s  rss {row['rss_mib']:7.1f} MiB  fds {row['fds']:4.0f}  "
          f"kv {info.kv_blocks_used:5d}/{info.kv_blocks_total}  done {done.done:4d}  "
          f"cancelled {done.cancelled:3d}  e2e p50 {row['e2e_ms']['p50']:7.0f} ms  "
          f"p99 {row['e2e_ms']['p99']:7.0f} ms  errors {len(done.errors)}", flush=True)
    return row


def run(args: argparse.Namespace) -> None:
    serve_args = ["--dtype", args.dtype, "--max-model-len", "256", "--kv-cache-memory", "256M",
                  "--max-num-seqs", str(max(args.concurrency, 1))]
    server = ServeProcess(*serve_args, *(["--model", args.model] if args.model else []))
    try:
        samples = asyncio.run(soak(server, args))
    finally:
        server.stop()
    report = Report("soak", machine_info(args.dtype), {**vars(args), "serve_args": serve_args})
    load, idle = samples[:-1], samples[-1]
    third = max(len(load) // 3, 1)
    first, last = load[:third], load[-third:]

    def median(rows: list[dict], key: str, sub: str | None = None) -> float:
        values = [r[key][sub] if sub else r[key] for r in rows]
        values = [v for v in values if v == v]  # windows with no finished request: NaN
        return statistics.median(values) if values else float("nan")

    metrics = (("RSS MiB", "rss_mib", None), ("open fds", "fds", None),
               ("e2e p50 ms", "e2e_ms", "p50"), ("e2e p99 ms", "e2e_ms", "p99"),
               ("TTFT p50 ms", "ttft_ms", "p50"))
    rows = [[label, f"{median(first, k, s):.1f}", f"{median(last, k, s):.1f}"]
            for label, k, s in metrics]
    if not report.quick:  # a quick run's drift says nothing: no ratio from it
        for row, (_, k, s) in zip(rows, metrics, strict=True):
            row.append(f"{median(last, k, s) / median(first, k, s):.2f}")
    errors = sorted({e for r in samples for e in r["errors"]})
    report.table(f"soak: {args.minutes:g} min, {args.concurrency} streams, {len(load)} samples; "
                 "medians over the first and the last third",
                 ["metric", "first third", "last third",
                  *([] if report.quick else ["last / first"])],
                 rows, note=f"finished {sum(r['done'] for r in load)}, cancelled "
                 f"{sum(r['cancelled'] for r in load)}, errors {len(errors)}; KV blocks in use "
                 f"once idle: {idle['kv_blocks_used']}")
    if errors:
        print(f"  errors: {errors[:5]}")
    report.data.update(samples=samples, idle_kv_blocks_used=idle["kv_blocks_used"])
    report.save(args.results, lambda fig: _draw(fig, load))


def _draw(fig: Any, samples: list[dict]) -> None:
    t = [r["t_s"] / 60 for r in samples]
    panels = [("resident memory, MiB", [r["rss_mib"] for r in samples]),
              ("open file descriptors", [r["fds"] for r in samples]),
              ("KV blocks in use", [r["kv_blocks_used"] for r in samples]),
              ("end-to-end latency, ms", None)]
    for i, (title, values) in enumerate(panels):
        ax = fig.add_subplot(1, 4, i + 1)
        if values is None:
            ax.plot(t, [r["e2e_ms"]["p50"] for r in samples], label="p50")
            ax.plot(t, [r["e2e_ms"]["p99"] for r in samples], label="p99")
            ax.legend(fontsize=7)
        else:
            ax.plot(t, values)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("minutes")
