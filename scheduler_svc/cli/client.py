"""A small synchronous client of the Generation service, for the CLI's generate and chat."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from batchwire.common.tls import ClientTls, channel
from batchwire.v1 import generate_pb2, generate_pb2_grpc

DEFAULT_ADDRESS = "localhost:50051"

# Keepalive pings every 30 s keep a long stream's connection open through proxies; the server
# accepts pings at that rate.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 16 << 20),
]


class GenerationClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, tls: ClientTls | None = None,
                 api_key: str | None = None) -> None:
        """tls: connect over TLS; api_key: sent as `authorization: Bearer <key>` on every call."""
        self.channel = channel(address, tls, CHANNEL_OPTIONS)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def wait_ready(self, timeout_s: float) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float | None = None
                 ) -> Iterator[generate_pb2.GenerateResponse]:
        """The response stream; closing the iterator early cancels the request."""
        call = self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def chat_request(self, messages: Sequence[tuple[str, str]],
                     sampling: generate_pb2.SamplingParams) -> generate_pb2.GenerateRequest:
        return generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages],
            sampling=sampling)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
