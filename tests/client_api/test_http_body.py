"""The HTTP front's body rules without a server: --max-request-bytes as parsed and defaulted,
and parse() refusing what no handler should see (no model loaded here)."""

from __future__ import annotations

import pytest

from scheduler_svc.cli import build_parser
from scheduler_svc.service.openai.body import (
    MIN_MAX_REQUEST_BYTES,
    BodyError,
    default_max_request_bytes,
    parse,
)
from scheduler_svc.service.server import ServerConfig


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_max_request_bytes_flag(command):
    assert build_parser().parse_args([command, "--max-request-bytes", "8M"]
                                     ).max_request_bytes == 8 << 20
    assert build_parser().parse_args([command]).max_request_bytes is None


def test_max_request_bytes_config_and_default():
    with pytest.raises(ValueError, match="max_request_bytes must be at least 1 KiB, got 10"):
        ServerConfig(max_request_bytes=10)
    assert default_max_request_bytes(0) == MIN_MAX_REQUEST_BYTES
    # 2048 tokens of up to 128 characters each, at 4 bytes a character, and 64 KiB besides.
    assert default_max_request_bytes(2048 * 128) == 4 * 2048 * 128 + (64 << 10)


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    (b'{"a": "\xed\xa0\x80"}', 400, None, "not UTF-8"),
    (b'{"a": NaN}', 400, None, "NaN is not JSON"),
    (b'{"a": [1, -Infinity]}', 400, None, "-Infinity is not JSON"),
    (b'{"a": [1, 1e400]}', 400, "a[1]", "numbers must be finite"),
    (b'{"m": [{"c": "x\\udc00"}]}', 400, "m[0].c", "(U+DC00) at character 1"),
    (b'{"m": {"\\ud800": 1}}', 400, "m", "a key of"),
    (b"[" * 66 + b"]" * 66, 400, None, "nested more than 64"),
    (b"[" * 200_000 + b"]" * 200_000, 400, None, "nested more than 64"),
    (b'{"seed": 1' + b"0" * 5000 + b"}", 400, None, "the body is not valid JSON"),
    (b'{"prompt": "hi",}', 400, None, "the body is not valid JSON: Expecting property name "
     "enclosed in double quotes at line 1, column 17 (character 16)"),
])
def test_parse_refuses(body, status, param, words):
    with pytest.raises(BodyError) as refused:
        parse(body)
    assert refused.value.status_code == status and refused.value.param == param
    assert words in refused.value.detail


def test_parse_keeps_what_is_valid():
    text = '{"prompt": "caf\\u00e9 \\ud83d\\ude00", "ids": [1, 2], "t": 0.5, "deep": ' \
           + "[" * 64 + "]" * 64 + "}"
    value = parse(text.encode())
    assert value["prompt"] == "café \U0001F600" and value["ids"] == [1, 2]
