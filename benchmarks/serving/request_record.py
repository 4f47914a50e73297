"""What the load generator keeps of one request, whichever API it went through: when it was sent
and when each message carrying tokens arrived. The gRPC client (load_generator.py) and the HTTP
client (openai_load.py) fill it; latency.py turns a run's records into serving metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    sent: float = 0.0  # perf_counter when the request left (after waiting for a free slot)
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # a message with tokens
    num_output_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
