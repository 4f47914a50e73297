"""`batchwire bench chaos`: a scheduler and --workers registering workers under a steady load of
seeded and greedy streams, while every --period-s one worker is, in turn, killed (SIGKILL),
frozen (SIGSTOP, thawed --thaw-s later: it registers again) or drained (SIGTERM: it finishes or
hands over its requests, then leaves), for --cycles cycles; a new worker is started for each
one killed or drained. The scheduler runs with --worker-grace-s, so a moment with no live
worker delays requests instead of failing them.

At the end every request must have finished exactly once (one final message, no error) with the
tokens of an undisturbed run (the offline engine on the same model, in this process), and no KV
block may be held. The dtype defaults to float32 here: the check compares tokens, and runs that
batch differently may round bfloat16 differently. A failed check exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from batchwire.benchmarks.shared.machine import machine_info
from batchwire.benchmarks.shared.report import Report
from batchwire.benchmarks.shared.serve_process import ServeProcess
from batchwire.benchmarks.shared.workloads import HIGH_ID, LOW_ID
from batchwire.v1 import generate_pb2, generate_pb2_grpc

ACTIONS = ("kill", "stop", "drain")
HEARTBEAT_S = 0.5  # the scheduler notices a frozen worker after about three periods
# Scheduler and workers alike (they must agree on the KV cache and the step's budget).
LIMITS = ("--max-model-len", "256", "--max-num-batched-tokens", "512", "--kv-cache-memory", "64M")
# Sampling values exact in float32, so that the wire's floats are the reference's.
SEEDED = dict(temperature=0.75, top_p=0.875, frequency_penalty=0.5, repetition_penalty=1.25)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=3, help="registered workers kept in the pool")
    p.add_argument("--cycles", type=int, default=12, help="workers killed, frozen or drained")
    p.add_argument("--period-s", type=float, default=4.0, help="seconds between two of them")
    p.add_argument("--thaw-s", type=float, default=3.0, help="how long a frozen worker stays so")
    p.add_argument("--concurrency", type=int, default=12, help="streams in flight at all times")
    p.add_argument("--grace-s", type=float, default=120.0, help="the scheduler's --worker-grace-s "
                   "(a default-model worker takes a while to start on a busy machine)")
    p.add_argument("--requests", type=int, default=2000, help="the most requests sent")
    p.set_defaults(dtype="float32")


def quick(args: argparse.Namespace) -> None:
    args.workers, args.cycles, args.period_s, args.thaw_s, args.concurrency = 2, 3, 1.0, 2.0, 6
    args.requests = 64
    shared = str(Path(args.results) / ".tiny-model")
    if args.model == shared:  # --quick's model, with peaked logits: no near-tie to flip
        from batchwire.benchmarks.shared.tiny_model import tiny_model

        args.model = tiny_model(Path(args.results) / ".tiny-model-peaked",
                                initializer_range=0.3, tokenizer_from=shared)


@dataclasses.dataclass
class Outcome:
    """What one client saw."""
    prompt: list[int]
    sampling: dict[str, Any]
    tokens: list[int] = dataclasses.field(default_factory=list)
    finals: int = 0  # messages with a finish_reason: exactly one, the last
    final_last: bool = True
    completion_tokens: int = -1
    error: str | None = None
    sent: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)  # of its messages

    @property
    def longest_stall_s(self) -> float:
        """The longest wait for a message, the first one included."""
        times = [self.sent, *self.times]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def make_requests(n: int, vocab: int) -> list[tuple[list[int], dict[str, Any]]]:
    """Half greedy, half seeded with penalties; sent in this order."""
    rng = random.Random(0)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(min(LOW_ID, vocab // 2), min(vocab, HIGH_ID))
                  for _ in range(rng.randint(8, 64))]
        sampling: dict[str, Any] = dict(max_tokens=rng.randint(16, 64), ignore_eos=True)
        if rng.random() < 0.5:
            sampling.update(temperature=0)
        else:
            sampling.update(SEEDED, seed=rng.randrange(1 << 30))
        requests.append((prompt, sampling))
    return requests


class Worker:
    """`python -m worker_svc --scheduler-address`, in a process group of its own."""

    def __init__(self, name: str, address: str, args: argparse.Namespace, folder: Path) -> None:
        self.name = name
        self.ready = folder / f"{name}.ready.json"
        cmd = [sys.executable, "-m", "worker_svc", "--dtype", args.dtype, *LIMITS,
               "--max-num-reqs", str(2 * args.concurrency), "--host", "127.0.0.1", "--port", "0",
               "--zmq-port", "0", "--no-metrics", "--ready-file", str(self.ready),
               "--scheduler-address", address, "--log-level", "WARNING",
               *(["--model", args.model] if args.model else [])]
        with open(folder / f"{name}.log", "w") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.state = "starting"  # starting, up, frozen, gone
        self.joined = False  # seen serving the scheduler

    @property
    def zmq_address(self) -> str | None:
        import json

        if not self.ready.exists():
            return None
        return f"127.0.0.1:{json.loads(self.ready.read_text())['ranks'][0]['zmq_port']}"

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.process.wait()


async def ready_addresses(stub: Any) -> set[str]:
    info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
    return {w.address for w in info.workers if w.state == generate_pb2.WORKER_STATE_READY}


async def stream(stub: Any, outcome: Outcome) -> None:
    request = generate_pb2.GenerateRequest(token_ids=outcome.prompt,
                                           sampling=generate_pb2.SamplingParams(**outcome.sampling))
    outcome.sent = time.perf_counter()
    try:
        async for reply in stub.Generate(request, timeout=600):
            if outcome.finals:
                outcome.final_last = False  # a message after the final one
            outcome.tokens.extend(reply.token_ids)
            outcome.times.append(time.perf_counter())
            if reply.finish_reason:
                outcome.finals += 1
                outcome.completion_tokens = reply.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        outcome.error = f"{e.code().name}: {e.details()}"


class Chaos:
    def __init__(self, server: ServeProcess, args: argparse.Namespace, folder: Path,
                 requests: list[tuple[list[int], dict[str, Any]]]) -> None:
        self.server, self.args, self.folder, self.requests = server, args, folder, requests
        self.workers: list[Worker] = []
        self.events: list[dict[str, Any]] = []
        self.outcomes: list[Outcome] = []
        self.start = time.perf_counter()

    def spawn(self) -> Worker:
        worker = Worker(f"worker-{len(self.workers)}", self.server.address, self.args,
                        self.folder)
        self.workers.append(worker)
        return worker

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.server.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            chaos_done = asyncio.Event()
            pending = iter(self.requests)

            async def load() -> None:
                while not chaos_done.is_set():
                    request = next(pending, None)
                    if request is None:
                        return  # all sent: --requests was too few for the run
                    outcome = Outcome(*request)
                    self.outcomes.append(outcome)
                    await stream(stub, outcome)

            loops = [asyncio.create_task(load()) for _ in range(self.args.concurrency)]
            try:
                await self.cycles(stub)
            finally:
                chaos_done.set()
            await asyncio.gather(*loops)
            self.kv_end = await self.idle_kv(stub)

    async def cycles(self, stub: Any) -> None:
        for i in range(self.args.cycles):
            await asyncio.sleep(self.args.period_s)
            action = ACTIONS[i % len(ACTIONS)]
            live = await self.live(stub)
            if not live:  # every one is frozen or gone: wait for one to (re)join
                live = await self.wait_live(stub)
            victim = live[0]  # the oldest
            if action == "kill":
                victim.signal(signal.SIGKILL)
                victim.state = "gone"
            elif action == "drain":
                victim.signal(signal.SIGTERM)
                victim.state = "gone"
            else:
                victim.signal(signal.SIGSTOP)
                victim.state = "frozen"
                asyncio.get_running_loop().call_later(self.args.thaw_s, self.thaw, victim)
            if action != "stop":
                self.spawn()
            self.note(action, victim.name, len(live) - 1)
        await self.wait_live(stub)  # the load ends with a worker serving it

    def thaw(self, worker: Worker) -> None:
        worker.signal(signal.SIGCONT)
        worker.state = "up"
        self.note("thaw", worker.name, None)

    def note(self, action: str, worker: str, live_after: int | None) -> None:
        t = time.perf_counter() - self.start
        self.events.append({"t_s": t, "action": action, "worker": worker,
                            "live_after": live_after})
        print(f"  t={t:5.1f} s  {action:5s} {worker}", flush=True)

    async def live(self, stub: Any) -> list[Worker]:
        ready = await ready_addresses(stub)
        live = [w for w in self.workers if w.state in ("starting", "up")
                and w.zmq_address in ready]
        for w in live:
            w.state, w.joined = "up", True
        return live

    async def wait_live(self, stub: Any) -> list[Worker]:
        deadline = time.perf_counter() + 300
        while not (live := await self.live(stub)):
            if time.perf_counter() > deadline:
                raise RuntimeError("no worker registered within 300 s")
            await asyncio.sleep(0.1)
        return live

    async def idle_kv(self, stub: Any) -> int:
        """KV blocks in use once every request has ended (they may take a step to be freed)."""
        for _ in range(100):
            info = await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=10)
            if not (info.kv_blocks_used or info.num_running_requests
                    or info.num_waiting_requests):
                break
            await asyncio.sleep(0.1)
        return info.kv_blocks_used


class Undisturbed(threading.Thread):
    """The tokens of an undisturbed run: an engine with its worker in this process (token ids in
    and out: no tokenizer to load), alongside the chaos, in the order the requests are sent and
    a batch at a time, until it has covered those sent once the chaos is over."""

    def __init__(self, args: argparse.Namespace,
                 requests: list[tuple[list[int], dict[str, Any]]], sent: Any) -> None:
        super().__init__(name="undisturbed", daemon=True)
        self.args, self.requests, self.sent = args, requests, sent  # sent(): how many so far
        self.tokens: list[list[int]] = []
        self.over = threading.Event()  # the chaos is: no more requests will be sent
        self.start()

    def run(self) -> None:
        from scheduler_svc.config import SchedulerConfig
        from scheduler_svc.core.sampling_params import SamplingParams
        from scheduler_svc.engine.engine_core import EngineCore

        args = self.args
        engine = EngineCore(SchedulerConfig(
            model=args.model, dtype=args.dtype, max_model_len=256, max_num_batched_tokens=512,
            max_num_seqs=2 * args.concurrency, kv_cache_memory_bytes=64 << 20))
        size = 2 * args.concurrency
        try:
            while len(self.tokens) < len(self.requests):
                ahead = len(self.tokens) - self.sent()
                if self.over.is_set() and ahead >= 0:
                    break
                if not self.over.is_set() and ahead >= size:
                    time.sleep(0.1)  # a batch ahead of the load is enough
                    continue
                first = len(self.tokens)
                batch = self.requests[first:first + size]
                tokens: dict[str, list[int]] = {str(first + i): [] for i in range(len(batch))}
                for i, (prompt, sampling) in enumerate(batch):
                    engine.add_request(prompt, SamplingParams(**sampling),
                                       request_id=str(first + i))
                while engine.has_requests():
                    for out in engine.step():
                        tokens[out.request_id].extend(out.new_token_ids)
                self.tokens.extend(tokens.values())
        finally:
            engine.shutdown()


def vocab_size(model: str | None) -> int:
    """A checkpoint's from its config.json; a GGUF file's: the default model's range, which
    every benchmark draws its prompts from."""
    import json

    from batchwire.common.model_files import resolve_model_path

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return HIGH_ID
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def run(args: argparse.Namespace) -> None:
    scheduler_args = ["--dtype", args.dtype, *LIMITS, "--transport", "zmq", "--no-http",
                      "--max-num-seqs", str(2 * args.concurrency), "--generation-config", "none",
                      "--worker-grace-s", str(args.grace_s),
                      "--worker-heartbeat-s", str(HEARTBEAT_S), "--log-level", "WARNING",
                      *(["--model", args.model] if args.model else [])]
    server = ServeProcess(*scheduler_args, command="scheduler", wait_serving=False)
    folder = Path(tempfile.mkdtemp(prefix="bw-bench-chaos-"))
    requests = make_requests(args.requests, vocab_size(args.model))
    chaos = Chaos(server, args, folder, requests)
    undisturbed = Undisturbed(args, requests, lambda: len(chaos.outcomes))
    try:
        for _ in range(args.workers):
            chaos.spawn()
        server.wait_serving()
        chaos.start = time.perf_counter()
        asyncio.run(chaos.run())
    finally:
        for worker in chaos.workers:
            worker.kill()
        server.stop()
    duration = time.perf_counter() - chaos.start
    undisturbed.over.set()
    undisturbed.join()
    if len(undisturbed.tokens) < len(chaos.outcomes):
        raise SystemExit("bench chaos: the undisturbed run failed (its error is above)")
    report_results(args, chaos, undisturbed.tokens[:len(chaos.outcomes)], duration)


def report_results(args: argparse.Namespace, chaos: Chaos, expected: list[list[int]],
                   duration: float) -> None:
    outcomes = chaos.outcomes
    errors = [o.error for o in outcomes if o.error]
    once = [o.finals == 1 and o.final_last and o.completion_tokens == len(o.tokens)
            for o in outcomes]
    identical = [o.tokens == e for o, e in zip(outcomes, expected, strict=True)]
    stalls = [o.longest_stall_s for o in outcomes]
    counts = {a: sum(e["action"] == a for e in chaos.events) for a in (*ACTIONS, "thaw")}
    ok = all(once) and all(identical) and not errors and chaos.kv_end == 0
    joined = sum(w.joined for w in chaos.workers[args.workers:])
    report = Report("chaos", machine_info(args.dtype), vars(args))
    report.table("chaos: what was done to the workers", ["t s", "action", "worker",
                                                          "live after"],
                 [[f"{e['t_s']:.1f}", e["action"], e["worker"],
                   "" if e["live_after"] is None else e["live_after"]] for e in chaos.events])
    report.table(f"chaos: {args.cycles} cycles every {args.period_s:g} s, {args.workers} workers, "
                 f"{args.concurrency} streams, {duration:.0f} s",
                 ["check", "result"],
                 [["requests", len(outcomes)],
                  ["finished exactly once", f"{sum(once)}/{len(outcomes)}"],
                  ["tokens of an undisturbed run", f"{sum(identical)}/{len(outcomes)}"],
                  ["errors", len(errors)],
                  ["KV blocks in use at the end", chaos.kv_end],
                  ["longest stall of a stream, s", f"{max(stalls, default=0):.2f}"],
                  ["killed / frozen / drained", f"{counts['kill']} / {counts['stop']} / "
                   f"{counts['drain']}"],
                  ["new workers started / joined under load",
                   f"{len(chaos.workers) - args.workers} / {joined}"]],
                 note="every request must finish once with the undisturbed tokens and leave no "
                 "KV block behind" + ("" if ok else ": FAILED"))
    if errors:
        print(f"  errors: {sorted(set(errors))[:5]}")
    report.data.update(
        events=chaos.events, num_requests=len(outcomes), finished_once=sum(once),
        identical=sum(identical), errors=errors, kv_blocks_used_end=chaos.kv_end,
        longest_stall_s=max(stalls, default=0.0), ok=ok, new_workers_joined=joined,
        mismatched=[i for i, same in enumerate(identical) if not same][:20])
    report.save(args.results, lambda fig: _draw(fig, chaos))
    if not ok:
        raise SystemExit("bench chaos: a request was lost, duplicated, changed, or left KV "
                         "blocks behind")


def _draw(fig: Any, chaos: Chaos) -> None:
    """Tokens streamed per half second, with the workers' events."""
    ax = fig.add_subplot(1, 1, 1)
    times = sorted(t - chaos.start for o in chaos.outcomes for t in o.times)
    if times:
        bins = max(int(times[-1] / 0.5) + 1, 1)
        ax.hist(times, bins=bins, color="tab:blue")
    colors = {"kill": "tab:red", "stop": "tab:purple", "drain": "tab:orange",
              "thaw": "tab:green"}
    for e in chaos.events:
        ax.axvline(e["t_s"], color=colors[e["action"]], linestyle="--", linewidth=1)
        ax.text(e["t_s"], ax.get_ylim()[1] * 0.95, e["action"], rotation=90, fontsize=7,
                va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("messages per 0.5 s")
