"""One streamed /v1/completions at a time, timed per SSE event: the client of `bench latency`,
the same for batchwire and llama-server. Synchronous and stdlib-only, so that the client's own cost
per event is small and equal for both servers."""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
from urllib.parse import urlsplit


@dataclasses.dataclass(slots=True)
class StreamTiming:
    ttft_s: float  # from sending to the first event that carries a token
    tpot_s: float  # (last token's event - first token's event) / (tokens - 1); nan for 1 token
    output_tokens: int


def stream_completion(base_url: str, prompt: list[int], max_tokens: int) -> StreamTiming:
    """Greedy, EOS ignored, prompt as token ids (the same ids reach both servers: no tokenizer
    sits between them). Raises RuntimeError when the server answers anything but max_tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False,  # llama-server: no prefix reuse across runs
            # batchwire: each event says how many tokens so far (an event may carry several).
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=600)
    try:
        sent = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        times, tokens, usage_tokens = [], 0, None
        while line := response.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now, event = time.perf_counter(), json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            usage = (event.get("usage") or {}).get("completion_tokens")
            if usage is not None:
                usage_tokens = usage
            # A server without per-event usage (llama-server) sends one event per token.
            new = (usage - tokens if usage is not None
                   else sum(1 for c in event.get("choices", ()) if c.get("text")))
            if new > 0:
                times.append(now)
                tokens += new
    finally:
        connection.close()
    tokens = usage_tokens if usage_tokens is not None else tokens
    if tokens != max_tokens or not times:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {tokens}")
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return StreamTiming(times[0] - sent, tpot, tokens)
