"""A Generation client run on a test host (`python -m tests.hosts.client SPEC`): opens every
stream the JSON spec lists at once, prints `streaming` when each has its first `ready_tokens`
tokens, and at the end one JSON line per stream: its tokens, the time of each message
(time.monotonic(), the clock the test reads too: namespaces share it), the finish reason and how
many messages carried one, or the error code.

spec: {"address": "host:port", "tls_ca": path or null, "ready_tokens": int,
       "requests": [{"id", "prompt", "max_tokens"}]}; every request is greedy with ignore_eos.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc
from batchwire.v1 import generate_pb2, generate_pb2_grpc


def stream(stub, request: dict, result: dict, started: threading.Semaphore,
           ready_tokens: int) -> None:
    message = generate_pb2.GenerateRequest(
        request_id=request["id"], token_ids=request["prompt"],
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=request["max_tokens"],
                                             ignore_eos=True))
    announced = False
    try:
        for reply in stub.Generate(message, timeout=120):
            result["tokens"] += reply.token_ids
            result["times"].append(time.monotonic())
            if reply.finish_reason:
                result["finish_reason"] = reply.finish_reason
                result["finishes"] += 1
            if not announced and len(result["tokens"]) >= ready_tokens:
                announced = True
                started.release()
    except grpc.RpcError as e:
        result["error"] = e.code().name
    if not announced:
        started.release()


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("tls_ca"):
        with open(spec["tls_ca"], "rb") as f:
            channel = grpc.secure_channel(spec["address"], grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(spec["address"])
    stub = generate_pb2_grpc.GenerationStub(channel)
    results = [dict(id=r["id"], tokens=[], times=[], finish_reason=None, finishes=0, error=None)
               for r in spec["requests"]]
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=stream, args=(stub, r, out, started, spec["ready_tokens"]))
               for r, out in zip(spec["requests"], results, strict=True)]
    for t in threads:
        t.start()
    for _ in threads:
        started.acquire()
    print("streaming", flush=True)
    for t in threads:
        t.join()
    for out in results:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
