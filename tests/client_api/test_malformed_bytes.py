"""Bytes that are not the method's message get INVALID_ARGUMENT from every service on the
scheduler's port (they got UNKNOWN before: gRPC's own deserializer failed outside the handler),
and the server goes on serving."""

from __future__ import annotations

import grpc
import pytest

from tests.client_api.server_process import collect, greedy, text_request

pytestmark = pytest.mark.slow

METHODS = [  # (method, streams its reply)
    ("/batchwire.v1.Generation/Generate", True),
    ("/batchwire.v1.Generation/Abort", False),
    ("/batchwire.v1.Generation/GetModelInfo", False),
    ("/batchwire.v1.Generation/Tokenize", False),
    ("/batchwire.v1.Generation/Detokenize", False),
    ("/batchwire.v1.Generation/Embed", False),
    ("/batchwire.v1.WorkerRegistry/Register", False),
    ("/grpc.health.v1.Health/Check", False),
    ("/grpc.health.v1.Health/Watch", True),
]
GARBAGE = [
    b"\xff\xff\xff\xff",  # a field number of 0 / a truncated varint
    b"\x0a\xff\x01abc",  # a length-delimited field longer than the message
    b"\x0b",  # a start-group tag with no end
    bytes(range(256)),
]


@pytest.mark.parametrize(("method", "streams"), METHODS, ids=[m[0].rsplit("/", 1)[1]
                                                              for m in METHODS])
def test_garbage_bytes_get_invalid_argument(server, method, streams):
    call = (server.channel.unary_stream if streams else server.channel.unary_unary)(method)
    for payload in GARBAGE:
        with pytest.raises(grpc.RpcError) as e:
            reply = call(payload, timeout=30)
            if streams:
                list(reply)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, e.value)
        assert "is not a valid" in e.value.details()
    ids, _, last, _ = collect(server.stub.Generate(text_request("Hi", greedy(3)), timeout=60))
    assert len(ids) == 3 and last.finish_reason == "length"
