"""Per-step transport cost at a steady decode step: in-process vs ZMQ vs gRPC, next to the floor.

A step is the two calls, ExecuteModel (the logits parked, nothing returned) then SampleTokens
(one token per request back). The worker here is a null worker behind the real servers, so what
is timed is the transport: serializing, sending, parsing, the servers' own dispatch. The floor,
measured in the same run, is a bare echo of the same byte sizes, frames and call pattern over the
same transport between two processes (ZMQ ROUTER/DEALER; gRPC sync unary, and aio unary since
the worker's gRPC server is grpc.aio).

    .venv/bin/python -m batchwire.benchmarks.engine.transport --requests 256 --steps 200 --rounds 20

With --w64, also workload W64 on the default model end to end (LLM.generate) with the in-process
worker and with a local worker process over ZMQ and over gRPC, the three taking turns: useful
output tokens per second, and what each transport costs against in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import zmq
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.v1 import worker_pb2 as pb

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.executors.uni import UniProcExecutor

SERVICE = "batchwire.v1.Worker"


# -- the workload -------------------------------------------------------------------------------


def answer(so: pb.SchedulerOutput, token: int = 4242) -> pb.ModelRunnerOutput:
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    sampled = [pb.TokenIds(ids=[token])] * len(ids)
    return pb.ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def steady_decode_steps(num_reqs: int, num_steps: int = 16) -> list[pb.SchedulerOutput]:
    """Consecutive decode steps of num_reqs running requests (W64-like prompt lengths, 32..256),
    built by the real scheduler once every prefill is done."""
    block_size, max_len = 16, 512
    config = SchedulerConfig(max_num_seqs=num_reqs, max_model_len=max_len,
                             max_num_batched_tokens=num_reqs * 256, block_size=block_size)
    scheduler = Scheduler(config, num_blocks=num_reqs * (max_len // block_size) + 1,
                          block_size=block_size, vocab_size=49152, eos_token_ids=[2])
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(num_reqs):
        length = 32 + (i * 97) % 225
        scheduler.add_request([100 + (7919 * i + j) % 48900 for j in range(length)], params)
    steps = []
    for n in range(8 + num_steps):
        so = scheduler.schedule()
        scheduler.update_from_output(so, answer(so))
        if n >= 8:
            steps.append(so)
    assert all(not s.scheduled_new_reqs for s in steps), "not steady: requests still arriving"
    return steps


class NullWorker:
    """Parks nothing, computes nothing: one token per request, the answer built once."""

    def __init__(self) -> None:
        self.reply: pb.ModelRunnerOutput | None = None

    def get_info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(model_name="null", vocab_size=49152, max_model_len=512,
                             num_blocks=1 << 16, block_size=16, tensor_parallel_size=1, rank=0,
                             max_num_reqs=4096)

    def execute_model(self, so: pb.SchedulerOutput) -> None:
        if self.reply is None:
            self.reply = answer(so)
        return None

    def sample_tokens(self, grammar: pb.GrammarOutput | None) -> pb.ModelRunnerOutput:
        return self.reply or pb.ModelRunnerOutput()

    def reset(self) -> None:
        pass


# -- servers, each in its own process -----------------------------------------------------------


def serve_null(ready_file: str) -> None:
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.server.serve import ServeOptions, serve

    options = ServeOptions(host="127.0.0.1", grpc_port=0, zmq_port=0, ready_file=ready_file)
    asyncio.run(serve(WorkerConfig(), options, worker_factory=lambda _: NullWorker()))


def serve_zmq_echo(ready_file: str, reply_bytes: int) -> None:
    replies = {b"ExecuteModel": b"", b"SampleTokens": b"x" * reply_bytes}
    sock = zmq.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    _ready(ready_file, port)
    ok = b"\x00"
    while True:
        ident, method, _ = sock.recv_multipart()
        sock.send_multipart([ident, ok, replies.get(method, b"")])


def _echo_handlers(reply_bytes: int, wrap):
    replies = {"ExecuteModel": b"", "SampleTokens": b"x" * reply_bytes, "GetInfo": b""}
    return grpc.method_handlers_generic_handler(
        SERVICE, {m: grpc.unary_unary_rpc_method_handler(wrap(r)) for m, r in replies.items()})


def serve_grpc_echo(ready_file: str, reply_bytes: int) -> None:
    server = grpc.server(ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers((_echo_handlers(reply_bytes, lambda r: lambda req, ctx: r),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _ready(ready_file, port)
    server.wait_for_termination()


def serve_grpc_aio_echo(ready_file: str, reply_bytes: int) -> None:
    def wrap(reply):
        async def handle(request, context):
            return reply
        return handle

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_echo_handlers(reply_bytes, wrap),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        _ready(ready_file, port)
        await server.wait_for_termination()

    asyncio.run(run())


def _ready(path: str, port: int) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"port": port}, f)
    os.replace(path + ".tmp", path)


def start_server(kind: str, reply_bytes: int = 0) -> tuple[subprocess.Popen, dict]:
    ready = os.path.join(tempfile.mkdtemp(prefix="bw-bench-"), "ready.json")
    cmd = [sys.executable, "-m", "batchwire.benchmarks.engine.transport", "--serve", kind,
           "--ready-file", ready, "--reply-bytes", str(reply_bytes)]
    process = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{kind} server did not start")
        time.sleep(0.05)
    with open(ready) as f:
        return process, json.load(f)


# -- clients --------------------------------------------------------------------------------------


def time_steps(step, steps: list, n: int, warmup: int = 20) -> list[float]:
    for i in range(warmup):
        step(steps[i % len(steps)])
    samples = []
    clock = time.perf_counter_ns
    for i in range(n):
        so = steps[i % len(steps)]
        t0 = clock()
        step(so)
        samples.append((clock() - t0) / 1000)
    return samples


def executor_step(executor):
    def step(so):
        out = executor.execute_model(so, non_block=True).result()
        if out is None:
            out = executor.sample_tokens(None)
        return out
    return step


def zmq_echo_step(port: int):
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def step(so):
        sock.send_multipart([b"ExecuteModel", so.SerializeToString()])
        sock.recv_multipart()
        sock.send_multipart([b"SampleTokens", b""])
        sock.recv_multipart()
    return step


def grpc_echo_step(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    execute = channel.unary_unary(f"/{SERVICE}/ExecuteModel")
    sample = channel.unary_unary(f"/{SERVICE}/SampleTokens")

    def step(so):
        execute(so.SerializeToString())
        sample(b"")
    return step


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per case per round")
    ap.add_argument("--rounds", type=int, default=20,
                    help="rounds; the cases take turns within each, so load drifts hit all alike")
    ap.add_argument("--w64", action="store_true", help="also W64 end to end on the default model")
    ap.add_argument("--w64-rounds", type=int, default=3)
    ap.add_argument("--w64-only", action="store_true", help="skip the per-step measurement")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every worker, in-process or not (W64)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--reply-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        servers = {"null": lambda: serve_null(args.ready_file),
                   "zmq-echo": lambda: serve_zmq_echo(args.ready_file, args.reply_bytes),
                   "grpc-echo": lambda: serve_grpc_echo(args.ready_file, args.reply_bytes),
                   "grpc-aio-echo": lambda: serve_grpc_aio_echo(args.ready_file, args.reply_bytes)}
        servers[args.serve]()
        return
    step_us = None if args.w64_only else run(args)
    if args.w64 or args.w64_only:
        run_w64(args, step_us)


def measure_steps(requests: int, num_steps: int, rounds: int
                  ) -> tuple[dict[str, list[list[float]]], list[int], int]:
    """Microseconds per step of each case, a list per round (the cases take turns in each);
    the SchedulerOutput sizes and the ModelRunnerOutput size in bytes."""
    from scheduler_svc.executors.grpc_executor import GrpcExecutor
    from scheduler_svc.executors.zmq_executor import ZmqExecutor

    steps = steady_decode_steps(requests)
    so_bytes = [s.ByteSize() for s in steps]
    reply = answer(steps[0])
    reply_bytes = reply.ByteSize()
    processes = []
    try:
        null, ports = start_server("null")
        processes.append(null)
        rank = ports["ranks"][0]
        config = SchedulerConfig(max_num_seqs=requests, max_model_len=512,
                                 max_num_batched_tokens=requests * 256)
        zmq_cfg = SchedulerConfig(**{**_fields(config), "worker_addresses": (
            f"127.0.0.1:{rank['zmq_port']}",)})
        grpc_cfg = SchedulerConfig(**{**_fields(config), "worker_addresses": (
            f"127.0.0.1:{rank['grpc_port']}",)})
        echo = {}
        for kind in ("zmq-echo", "grpc-echo", "grpc-aio-echo"):
            process, info = start_server(kind, reply_bytes)
            processes.append(process)
            echo[kind] = info["port"]
        executors = [UniProcExecutor(config, NullWorker()), ZmqExecutor(zmq_cfg),
                     GrpcExecutor(grpc_cfg)]
        cases = {
            "in-process": executor_step(executors[0]),
            "zmq": executor_step(executors[1]),
            "zmq floor (echo)": zmq_echo_step(echo["zmq-echo"]),
            "grpc": executor_step(executors[2]),
            "grpc floor (sync echo)": grpc_echo_step(echo["grpc-echo"]),
            "grpc aio echo": grpc_echo_step(echo["grpc-aio-echo"]),
        }
        samples: dict[str, list[list[float]]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, step in cases.items():
                samples[name].append(time_steps(step, steps, num_steps))
        for ex in executors:
            ex.shutdown()
    finally:
        for p in processes:
            os.killpg(p.pid, 9)
            p.wait()
    return samples, so_bytes, reply_bytes


def run(args: argparse.Namespace) -> dict[str, float]:
    """The per-step table; returns the median us per step of each case."""
    rounds, so_bytes, reply_bytes = measure_steps(args.requests, args.steps, args.rounds)
    samples = {name: [us for r in per_round for us in r] for name, per_round in rounds.items()}
    med = {name: statistics.median(s) for name, s in samples.items()}
    print(f"steady decode step of {args.requests} requests; {args.rounds} rounds x {args.steps} "
          f"steps per case, interleaved")
    print(f"SchedulerOutput on the wire: median {statistics.median(so_bytes):.0f} B "
          f"(min {min(so_bytes)}, max {max(so_bytes)}); ExecuteModelResponse 0 B; GrammarOutput "
          f"0 B; ModelRunnerOutput {reply_bytes} B")
    print(f"{'case':<24}{'median us/step':>16}{'p90':>10}")
    for name, s in samples.items():
        p90 = statistics.quantiles(s, n=10)[-1]
        print(f"{name:<24}{med[name]:>16.1f}{p90:>10.1f}")
    print(f"zmq / its floor:  {med['zmq'] / med['zmq floor (echo)']:.2f}x")
    print(f"grpc / its floor: {med['grpc'] / med['grpc floor (sync echo)']:.2f}x "
          f"(vs an aio echo: {med['grpc'] / med['grpc aio echo']:.2f}x)")
    print(f"grpc / zmq: {med['grpc'] / med['zmq']:.2f}x; "
          f"in-process step {med['in-process']:.1f} us")
    return med


def run_w64(args: argparse.Namespace, step_us: dict[str, float] | None = None) -> None:
    import torch
    from batchwire.benchmarks.shared.workloads import w64

    from scheduler_svc.engine.llm import LLM

    # The same compute for all three. NOTE: on a busy 2-core machine torch's 2-thread OpenMP
    # regions run many times slower on a process's main thread (where the in-process worker
    # runs) than on another thread (where a worker server runs the model): left alone, that
    # difference, not the transport, would decide the comparison.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the worker processes
    torch.set_num_threads(args.threads)
    workload = w64()
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    useful = sum(n for _, n in workload)
    # No prefix caching: every round is a whole W64, not the previous round's cache hits.
    settings = dict(dtype=args.dtype, kv_cache_memory_bytes=512 << 20, max_num_seqs=64,
                    max_num_batched_tokens=2048, max_model_len=512, enable_prefix_caching=False)
    engines = {name: LLM(executor_backend=name, **settings) for name in ("uni", "zmq", "grpc")}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    reference = None
    try:
        for llm in engines.values():  # warm-up: first forward passes of each shape
            llm.generate(prompts[:8], params[:8], use_tqdm=False)
        for _ in range(args.w64_rounds):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                steps_before = llm.engine.scheduler.stats.num_steps
                outputs = llm.generate(prompts, params, use_tqdm=False)
                num_steps = llm.engine.scheduler.stats.num_steps - steps_before
                rates[name].append(useful / (time.perf_counter() - t0))
                print(f"  W64 on {name}: {rates[name][-1]:.1f} tok/s", flush=True)
                tokens = [o.token_ids for o in outputs]
                reference = reference or tokens
                assert tokens == reference, f"{name} gave other tokens than uni"
    finally:
        for llm in engines.values():
            llm.shutdown()
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"W64 ({len(workload)} requests, {useful} useful output tokens, {args.dtype}, "
          f"{args.threads} torch thread(s) per worker), median of {args.w64_rounds} rounds, the "
          "three taking turns; tokens identical across them")
    for name, rate in med.items():
        cost = 100 * (1 - rate / med["uni"])
        print(f"{name:<6}{rate:>10.1f} tok/s   cost vs in-process {cost:+.1f}%   "
              f"runs {', '.join(f'{r:.1f}' for r in rates[name])}")
    if step_us is not None:
        # Robust to load drifts that the end-to-end runs are not: the per-step transport cost
        # measured above, times the steps of one W64 run, against that run's time in-process.
        seconds = useful / med["uni"]
        for name in ("zmq", "grpc"):
            extra_s = num_steps * (step_us[name] - step_us["in-process"]) / 1e6
            print(f"{name}: {num_steps} steps x {step_us[name] - step_us['in-process']:.0f} us of "
                  f"transport = {extra_s * 1000:.0f} ms, {100 * extra_s / seconds:.2f}% of a "
                  f"{seconds:.1f} s in-process W64")


def _fields(config: SchedulerConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


if __name__ == "__main__":
    main()
