"""A load generator over the client gRPC API or the OpenAI-compatible HTTP API (openai_load.py):
requests arrive as a Poisson process at a given rate (all at once for rate inf), at most
max_concurrency in flight, each stream timed as it arrives."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
from batchwire.benchmarks.serving import openai_load
from batchwire.benchmarks.serving.request_record import RequestRecord
from batchwire.benchmarks.shared.workloads import Workload
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from tqdm import tqdm


async def _one(stub, prompt: list[int], max_tokens: int, record: RequestRecord) -> None:
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(token_ids=prompt, sampling=sampling)
    record.sent = time.perf_counter()
    try:
        async for message in stub.Generate(request):
            if message.token_ids:
                record.chunk_times.append(time.perf_counter())
                record.num_output_tokens += len(message.token_ids)
            if message.finish_reason:
                record.finish_reason = message.finish_reason
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"


async def _run(address: str, workload: Workload, rate: float, max_concurrency: int,
               seed: int, desc: str, api: str) -> tuple[list[RequestRecord], float]:
    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency)
    records = [RequestRecord(len(p)) for p, _ in workload]
    openai = api == "openai"
    async with (openai_load.session() if openai else grpc.aio.insecure_channel(address)) as c:
        stub = None if openai else generate_pb2_grpc.GenerationStub(c)
        with tqdm(total=len(workload), desc=desc, unit="req", disable=None) as bar:
            async def send(i: int) -> None:
                async with slots:
                    prompt, max_tokens = workload[i]
                    if stub is None:
                        await openai_load.one(c, address, prompt, max_tokens, records[i])
                    else:
                        await _one(stub, prompt, max_tokens, records[i])
                bar.update(1)

            start, tasks = time.perf_counter(), []
            for i in range(len(workload)):
                tasks.append(asyncio.create_task(send(i)))
                if rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def generate_load(address: str, workload: Workload, rate: float, max_concurrency: int,
                  seed: int = 0, desc: str = "serve", api: str = "grpc"
                  ) -> tuple[list[RequestRecord], float]:
    """(one record per request, wall seconds from the first arrival to the last reply).
    address: host:port of the gRPC API, or the HTTP API's base URL with api "openai"."""
    return asyncio.run(_run(address, workload, rate, max_concurrency, seed, desc, api))
