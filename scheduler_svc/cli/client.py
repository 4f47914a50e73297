"""A small synchronous client of the Generation service, for the CLI's generate and chat."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from batchwire.common.tls import ClientTls, channel
from batchwire.v1 import generate_pb2, generate_pb2_grpc

DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"localhost:{DEFAULT_PORT}"

# Keepalive pings every 30 s keep a long stream's connection open through proxies; the server
# accepts pings at that rate.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 16 << 20),
]


def with_default_port(address: str) -> str:
    """`localhost` means localhost:50051: left alone, gRPC would dial port 443. Addresses with a
    scheme (`dns:///`, `unix:`) are gRPC's own and pass unchanged."""
    if "://" in address or address.startswith("unix:"):
        return address
    if address.startswith("["):  # [::1] or [::1]:50051
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if address.count(":") == 1:
        return address
    if ":" in address:  # a bare IPv6 address
        return f"[{address}]:{DEFAULT_PORT}"
    return f"{address}:{DEFAULT_PORT}"


@contextmanager
def interrupt_cancels() -> Iterator[Callable[[Any], Any]]:
    """Ctrl-C while a call made inside this block is under way cancels it; KeyboardInterrupt is
    raised here once the block has ended. Enter it before the call is made and pass the call
    (a gRPC call or future) to the function it yields. Left to Python's default handler,
    KeyboardInterrupt is raised at whatever line of gRPC's own Python code the main thread runs,
    which can leave a call's state half-updated: closing the channel then waits for that call
    forever. That includes the lines that make the call, after the server has it: a Ctrl-C there
    is held here until the call exists, then cancels it. Main thread only (signal handlers are
    set there)."""
    calls: list[Any] = []
    interrupted = False

    def cancel(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        for call in calls:
            call.cancel()

    def watch(call: Any) -> Any:
        calls.append(call)
        if interrupted:
            call.cancel()
        return call

    previous = signal.signal(signal.SIGINT, cancel)
    try:
        yield watch
    except (grpc.RpcError, grpc.FutureCancelledError):
        if not interrupted:
            raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


class GenerationClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, tls: ClientTls | None = None,
                 api_key: str | None = None) -> None:
        """tls: connect over TLS; api_key: sent as `authorization: Bearer <key>` on every call."""
        self.address = with_default_port(address)
        self.channel = channel(self.address, tls, CHANNEL_OPTIONS)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def wait_ready(self, timeout_s: float) -> None:
        """Raises ConnectionError when no server answers at the address within timeout_s."""
        try:
            with interrupt_cancels() as watch:
                watch(grpc.channel_ready_future(self.channel)).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"cannot reach a server at {self.address} within "
                                  f"{timeout_s:g} s (is one running? --address HOST:PORT "
                                  "names another)") from None

    def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float | None = None
                 ) -> Iterator[generate_pb2.GenerateResponse]:
        """The response stream; closing the iterator early cancels the request."""
        calls: list[Any] = []
        try:
            with interrupt_cancels() as watch:
                calls.append(watch(self.stub.Generate(request, timeout=timeout_s,
                                                      metadata=self.metadata)))
                yield from calls[0]
        finally:
            for call in calls:
                call.cancel()

    def model_info(self) -> generate_pb2.GetModelInfoResponse:
        with interrupt_cancels() as watch:
            info = watch(self.stub.GetModelInfo.future(
                generate_pb2.GetModelInfoRequest(), timeout=30, metadata=self.metadata)).result()
        return info

    def load_lora_adapters(self, modules: dict[str, str]) -> None:
        """Loads each name=path adapter the server does not serve yet; raises SystemExit for a
        name it serves from another path (and grpc.RpcError for a refused load)."""
        with interrupt_cancels() as watch:
            listed = watch(self.stub.ListLoRAAdapters.future(
                generate_pb2.ListLoRAAdaptersRequest(), timeout=30, metadata=self.metadata))
            served = {a.name: a.path for a in listed.result().adapters}
        for name, path in modules.items():
            if name in served and served[name] != path:
                raise SystemExit(f"batchwire: adapter {name!r} is loaded from {served[name]!r}, "
                                 f"not {path!r}")
            if name not in served:
                request = generate_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
                with interrupt_cancels() as watch:
                    watch(self.stub.LoadLoRAAdapter.future(request, timeout=60,
                                                           metadata=self.metadata)).result()

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
