"""The load generator's client for the OpenAI-compatible HTTP API: one streamed /v1/completions
per request (token-id prompt, greedy, ignore_eos), timed per SSE event as the gRPC client times
its messages. aiohttp keeps the client's own cost per event small: the client shares the machine
with the server, and a heavier one (the openai SDK parses each chunk into pydantic models)
would be measured as the server's."""

from __future__ import annotations

import json
import time
from typing import Any

from batchwire.benchmarks.serving.request_record import RequestRecord


def session() -> Any:
    try:
        import aiohttp
    except ModuleNotFoundError as e:
        raise SystemExit("bench serve --api openai needs aiohttp (pip install aiohttp)") from e
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=0))


async def one(client: Any, base_url: str, prompt: list[int], max_tokens: int,
              record: RequestRecord) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True,
            # Each event says how many tokens so far: a text delta alone does not.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    record.sent = time.perf_counter()
    try:
        async with client.post(f"{base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = event["error"]["message"]
                    return
                usage = event.get("usage") or {}
                tokens = usage.get("completion_tokens", record.num_output_tokens)
                if tokens > record.num_output_tokens:
                    record.chunk_times.append(time.perf_counter())
                    record.num_output_tokens = tokens
                for choice in event.get("choices", ()):
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except Exception as e:  # a refused connection, a cut stream
        record.error = f"{type(e).__name__}: {e}"
