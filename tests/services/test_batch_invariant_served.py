"""`batchwire serve --batch-invariant` over a ZMQ worker group: the flag reaches the worker it
starts, GetServerInfo and /metrics say the mode is on, and a greedy request's tokens and logprobs
over the wire are the same alone, beside 7 others sent with it, and again with its prompt's
blocks in the prefix cache. (The offline test, tests/worker/test_batch_invariant.py, controls
the batches exactly; this one proves the served path keeps the property.)"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

from batchwire.v1 import generate_pb2

from tests.client_api.server_process import ServerProcess, collect, greedy

TARGET = [(7 * i + 3) % 250 + 3 for i in range(40)]


def generate(server: ServerProcess, prompt: list[int], max_tokens: int = 8
             ) -> tuple[list[int], list[generate_pb2.TokenLogprob], int]:
    """(token ids, logprobs, cached prompt tokens) of one greedy request."""
    request = generate_pb2.GenerateRequest(token_ids=prompt,
                                           sampling=greedy(max_tokens, logprobs=3))
    logprobs: list[generate_pb2.TokenLogprob] = []
    responses = []
    for response in server.stub.Generate(request, timeout=120):
        logprobs.extend(response.logprobs)
        responses.append(response)
    ids, _, last, _ = collect(iter(responses))
    return ids, logprobs, last.usage.cached_tokens


def test_a_served_zmq_worker_keeps_a_request_bitwise_the_same(tmp_path,
                                                             tiny_llama_with_tokenizer):
    server = ServerProcess(tmp_path, "--model", tiny_llama_with_tokenizer, "--transport", "zmq",
                           "--batch-invariant", "--max-num-batched-tokens", "64",
                           "--max-num-seqs", "16", "--no-http")
    try:
        server.wait_serving()
        info = server.server_info()
        assert info.batch_invariant and info.transport == "zmq"
        assert re.search(r"^batchwire_batch_invariant 1\.0$", server.metrics(), re.M)

        alone_ids, alone_logprobs, cached = generate(server, TARGET)
        assert cached == 0 and len(alone_ids) == 8 and len(alone_logprobs) == 8

        rng = random.Random(7)
        others = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 80))] for _ in range(7)]
        with ThreadPoolExecutor(len(others) + 1) as pool:
            beside = [pool.submit(generate, server, p, rng.randint(1, 12)) for p in others]
            target = pool.submit(generate, server, TARGET).result()
            assert all(len(f.result()[0]) > 0 for f in beside)
        # The target's second run finds its two full blocks cached.
        assert target[2] == 32
        assert target[:2] == (alone_ids, alone_logprobs)  # logprobs compared exactly
    finally:
        server.stop()
