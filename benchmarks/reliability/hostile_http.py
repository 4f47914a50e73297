"""`batchwire bench hostile-http`: a table of hostile requests against the HTTP front of a
`batchwire serve` this starts (in a process group of its own, killed at the end), while a
well-behaved greedy stream runs beside it.

The table: integers no message can hold, lone surrogates and bytes that are not UTF-8, values of
the wrong JSON type, NaN / Infinity / out-of-range floats, deep nesting, huge bodies (50 MB of
token ids, 5 million characters to /tokenize), malformed JSON, and malformed HTTP (bad chunking,
negative Content-Length, a 1 MB header, TLS to the plain port), which uvicorn answers itself
with a plain-text 400 before the application sees it.

Printed per case: the status and whether the body is OpenAI's error object; then the stream's
worst gap between chunks idle and during the table, and the peak growth of the server's
resident memory (its whole process group). The bar (issue 26): no 5xx, every 4xx of the
application an error object, the server alive and answering the greedy request as before; peak
RSS growth under 300 MB; the worst gap under 5x the idle one + 0.2 s. The first three set the
exit status (1 when broken); the figures are reported against theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from batchwire.benchmarks.shared.serve_process import ServeProcess

MB = 1 << 20
RSS_BAR_BYTES = 300 * MB
SEND_CHUNK = 256 << 10
GREEDY = {"prompt": "Write a story about a lighthouse keeper.", "temperature": 0,
          "ignore_eos": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-tokens", type=int, default=64,
                   help="tokens of each greedy stream that runs beside the table")
    p.add_argument("--serve-args", default="", help="more `batchwire serve` arguments, as one "
                   "string (e.g. '--max-request-bytes 4M')")


def quick(args: argparse.Namespace) -> None:
    args.stream_tokens = 32


@dataclasses.dataclass
class Case:
    group: str
    name: str
    request: bytes  # the whole HTTP request as sent, head and body
    http_layer: bool = False  # malformed HTTP: uvicorn's own plain-text 400 is the answer


@dataclasses.dataclass
class Outcome:
    case: Case
    status: int  # 0: the connection closed with no answer
    error_object: bool
    seconds: float
    rss_growth: int  # peak RSS during the case over the baseline, bytes


# ---------------------------------------------------------------- the cases


def http_request(path: str, body: bytes, content_type: str = "application/json",
                 extra: str = "") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


def js(path: str, text: str) -> bytes:
    return http_request(path, text.encode("utf-8", "surrogatepass"))


def _int_cases() -> list[Case]:
    out = []
    big = {"2**31": 2**31, "-2**31-1": -2**31 - 1, "2**63": 2**63, "2**80": 2**80,
           "-2**80": -2**80, "10**12": 10**12}
    for field in ("max_tokens", "n", "seed", "top_k", "min_tokens", "priority", "logprobs",
                  "truncate_prompt_tokens", "best_of"):
        for label in ("2**80", "-2**80") if field != "priority" else big:
            body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {big[label]}}}'
            if field == "max_tokens":
                body = f'{{"prompt": "hi", "max_tokens": {big[label]}}}'
            out.append(Case("huge integers", f"completions {field}={label}",
                            js("/v1/completions", body)))
    for label in ("10**12", "2**31", "-2**80"):
        value = big[label]
        out += [
            Case("huge integers", f"completions prompt=[{label}]",
                 js("/v1/completions", f'{{"prompt": [{value}], "max_tokens": 2}}')),
            Case("huge integers", f"completions prompt=[[1, {label}]]",
                 js("/v1/completions", f'{{"prompt": [[1, {value}]], "max_tokens": 2}}')),
            Case("huge integers", f"detokenize tokens=[{label}]",
                 js("/detokenize", f'{{"tokens": [{value}]}}')),
            Case("huge integers", f"embeddings input=[{label}]",
                 js("/v1/embeddings", f'{{"input": [{value}]}}')),
        ]
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    for field in ("max_completion_tokens", "top_logprobs", "priority"):
        out.append(Case("huge integers", f"chat {field}=2**80",
                        js("/v1/chat/completions", f'{{{chat}, "{field}": {2**80}}}')))
    for field in ("stop_token_ids", "allowed_token_ids"):
        out.append(Case("huge integers", f"completions {field}=[2**80]", js(
            "/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "{field}": [{2**80}]}}')))
    out.append(Case("huge integers", "seed with 5000 digits", js(
        "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": 1' + "0" * 5000 + "}")))
    return out


def _text_cases() -> list[Case]:
    s = "\\ud800"  # a lone surrogate, JSON-escaped
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    escaped = [
        ("completions model", "/v1/completions", f'{{"prompt": "hi", "model": "{s}"}}'),
        ("completions prompt", "/v1/completions", f'{{"prompt": "a{s}b", "max_tokens": 2}}'),
        ("completions prompt list", "/v1/completions",
         f'{{"prompt": ["ok", "{s}"], "max_tokens": 2}}'),
        ("completions low surrogate", "/v1/completions",
         '{"prompt": "\\udfff", "max_tokens": 2}'),
        ("completions reversed pair", "/v1/completions",
         '{"prompt": "\\ude00\\ud83d", "max_tokens": 2}'),
        ("completions stop", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "stop": ["{s}"]}}'),
        ("completions bad_words", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "bad_words": ["{s}"]}}'),
        ("completions logit_bias key", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "logit_bias": {{"{s}": 1}}}}'),
        ("completions cache_salt", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "cache_salt": "{s}"}}'),
        ("completions user", "/v1/completions", f'{{"prompt": "hi", "user": "{s}"}}'),
        ("completions unknown key", "/v1/completions", f'{{"prompt": "hi", "{s}": 1}}'),
        ("chat content", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "x{s}"}}], "max_tokens": 2}}'),
        ("chat content part", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{s}"}}]}}]}}'),
        ("chat role", "/v1/chat/completions",
         f'{{"messages": [{{"role": "{s}", "content": "hi"}}]}}'),
        ("chat name", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "hi", "name": "{s}"}}]}}'),
        ("chat model", "/v1/chat/completions", f'{{{chat}, "model": "{s}"}}'),
        ("chat json schema", "/v1/chat/completions",
         f'{{{chat}, "response_format": {{"type": "json_schema", "json_schema": '
         f'{{"name": "x", "schema": {{"type": "string", "pattern": "{s}"}}}}}}}}'),
        ("chat tool name", "/v1/chat/completions",
         f'{{{chat}, "tools": [{{"type": "function", "function": {{"name": "{s}"}}}}]}}'),
        ("tokenize prompt", "/tokenize", f'{{"prompt": "{s}"}}'),
        ("tokenize messages", "/tokenize",
         f'{{"messages": [{{"role": "user", "content": "{s}"}}]}}'),
        ("embeddings input", "/v1/embeddings", f'{{"input": "{s}"}}'),
    ]
    out = [Case("lone surrogates", f"{name} (escaped)", js(path, body))
           for name, path, body in escaped]
    raw = [  # bytes that are not UTF-8
        ("surrogate bytes ed a0 80 in prompt", "/v1/completions",
         b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),
        ("surrogate bytes in chat", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
        ("surrogate bytes in tokenize", "/tokenize", b'{"prompt": "\xed\xb0\x80"}'),
        ("byte ff", "/v1/completions", b'{"prompt": "\xff", "max_tokens": 2}'),
        ("overlong c0 af", "/v1/completions", b'{"prompt": "\xc0\xaf", "max_tokens": 2}'),
        ("truncated e2 82", "/v1/completions", b'{"prompt": "\xe2\x82", "max_tokens": 2}'),
        ("latin-1 body", "/v1/completions", '{"prompt": "café"}'.encode("latin-1")),
        ("UTF-16 body", "/v1/completions", '{"prompt": "hi"}'.encode("utf-16")),
    ]
    out += [Case("bytes not UTF-8", name, http_request(path, body)) for name, path, body in raw]
    return out


def _type_cases() -> list[Case]:
    wrong = [
        ("max_tokens \"10\"", '"max_tokens": "10"'), ("max_tokens 10.5", '"max_tokens": 10.5'),
        ("max_tokens 2.0", '"max_tokens": 2.0'), ("max_tokens true", '"max_tokens": true'),
        ("stream \"yes\"", '"stream": "yes"'), ("stream 1", '"stream": 1'),
        ("stream \"true\"", '"stream": "true"'), ("echo \"no\"", '"echo": "no"'),
        ("n \"2\"", '"n": "2"'), ("temperature \"hot\"", '"temperature": "hot"'),
        ("stop 5", '"stop": 5'), ("logit_bias list", '"logit_bias": [1, 2]'),
        ("logit_bias key \"x\"", '"logit_bias": {"x": 1}'),
        ("stream_options \"yes\"", '"stream": true, "stream_options": "yes"'),
    ]
    out = [Case("wrong JSON types", f"completions {name}",
                js("/v1/completions", f'{{"prompt": "hi", {field}}}')) for name, field in wrong]
    out += [
        Case("wrong JSON types", "completions prompt {}", js("/v1/completions", '{"prompt": {}}')),
        Case("wrong JSON types", "completions prompt 5", js("/v1/completions", '{"prompt": 5}')),
        Case("wrong JSON types", "completions prompt [[]]",
             js("/v1/completions", '{"prompt": [[]]}')),
        Case("wrong JSON types", "chat messages \"hello\"",
             js("/v1/chat/completions", '{"messages": "hello"}')),
        Case("wrong JSON types", "chat logprobs 1", js("/v1/chat/completions",
             '{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}')),
        Case("wrong JSON types", "detokenize tokens \"1 2\"",
             js("/detokenize", '{"tokens": "1 2"}')),
        Case("wrong JSON types", "tokenize add_special_tokens \"yes\"",
             js("/tokenize", '{"prompt": "hi", "add_special_tokens": "yes"}')),
    ]
    return out


def _float_cases() -> list[Case]:
    values = [
        ("logit_bias 1e308", '"logit_bias": {"5": 1e308}'),
        ("logit_bias Infinity", '"logit_bias": {"5": Infinity}'),
        ("logit_bias -Infinity", '"logit_bias": {"5": -Infinity}'),
        ("logit_bias NaN", '"logit_bias": {"5": NaN}'),
        ("logit_bias 101", '"logit_bias": {"5": 101}'),
        ("logit_bias 1e400", '"logit_bias": {"5": 1e400}'),
        ("temperature NaN", '"temperature": NaN'),
        ("temperature Infinity", '"temperature": Infinity'),
        ("temperature 1e400", '"temperature": 1e400'),
        ("top_p NaN", '"top_p": NaN'),
        ("presence_penalty 1e308", '"presence_penalty": 1e308'),
        ("repetition_penalty 1e400", '"repetition_penalty": 1e400'),
        ("min_p -1e308", '"min_p": -1e308'),
    ]
    return [Case("non-finite and out-of-range floats", f"completions {name}",
                 js("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, {field}}}'))
            for name, field in values]


def _nesting_cases() -> list[Case]:
    out = []
    for depth in (1_000, 100_000, 1_000_000):
        out.append(Case("deep nesting", f"{depth} nested arrays",
                        http_request("/v1/completions", b"[" * depth + b"]" * depth)))
    deep = '{"a": ' * 200 + "1" + "}" * 200
    out += [
        Case("deep nesting", "200 nested objects in response_format",
             js("/v1/completions", f'{{"prompt": "hi", "response_format": {deep}}}')),
        Case("deep nesting", "200 nested objects in a json_schema", js(
            "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", '
            f'"schema": {deep}}}}}}}')),
        Case("deep nesting", "200 nested objects in tool parameters", js(
            "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
            f'"tools": [{{"type": "function", "function": {{"name": "f", '
            f'"parameters": {deep}}}}}]}}')),
        Case("deep nesting", "100k nested arrays as prompt", js(
            "/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}")),
    ]
    return out


def _size_cases() -> list[Case]:
    ids_50mb = b'{"max_tokens": 2, "prompt": [' + b"12345," * (50 * MB // 6) + b"1]}"
    many_ids = b'{"tokens": [' + b"7," * (500_000) + b"7]}"
    text_5m = b'{"prompt": "' + b"ab " * (5_000_000 // 3) + b'"}'
    text_900k = b'{"prompt": "' + b"x" * 900_000 + b'"}'
    return [
        Case("huge bodies", "50 MB of token ids to completions",
             http_request("/v1/completions", ids_50mb)),
        Case("huge bodies", "5 M characters to /tokenize", http_request("/tokenize", text_5m)),
        Case("huge bodies", "5 M characters of chat content", http_request(
            "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "'
            + b"ab " * (5_000_000 // 3) + b'"}]}')),
        Case("huge bodies", "900 k characters to /tokenize", http_request("/tokenize", text_900k)),
        Case("huge bodies", "500 k ids to /detokenize", http_request("/detokenize", many_ids)),
        Case("huge bodies", "2049 prompts", js(
            "/v1/completions", '{"max_tokens": 1, "prompt": [' + '"hi",' * 2048 + '"hi"]}')),
        Case("huge bodies", "10 k prompts", js(
            "/v1/completions", '{"max_tokens": 1, "prompt": [' + '"hi",' * 9999 + '"hi"]}')),
        Case("huge bodies", "100 k logit_bias entries", js(
            "/v1/completions", '{"prompt": "hi", "max_tokens": 1, "logit_bias": {'
            + ",".join(f'"{i}": 1' for i in range(100_000)) + "}}")),
        Case("huge bodies", "2049 embeddings inputs", js(
            "/v1/embeddings", '{"input": [' + '"hi",' * 2048 + '"hi"]}')),
        Case("huge bodies", "10 k stop strings", js(
            "/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": ['
            + ",".join('"s"' for _ in range(10_000)) + "]}")),
        Case("huge bodies", "Content-Length 1 GB, no body", (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")),
    ]


def _json_cases() -> list[Case]:
    bodies = [("empty body", b""), ("not JSON", b"hello"), ("truncated", b'{"prompt": "hi"'),
              ("trailing garbage", b'{"prompt": "hi"} x'), ("top-level array", b"[1, 2]"),
              ("top-level null", b"null"), ("UTF-8 BOM", b'\xef\xbb\xbf{"prompt": "hi"}'),
              ("NUL bytes", b'{"prompt": "\x00"}')]
    out = [Case("malformed JSON", name, http_request("/v1/completions", body))
           for name, body in bodies]
    out.append(Case("malformed JSON", "text/plain content type",
                    http_request("/v1/completions", b'{"prompt": "hi"}', "text/plain")))
    return out


def _http_cases() -> list[Case]:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    body = b'{"prompt": "hi", "max_tokens": 1}'
    tls_hello = bytes.fromhex("16030100a5010000a10303") + os.urandom(32) + b"\x00" * 60
    cases = [
        ("bad chunk size", head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
        ("chunk longer than declared", head + b"Transfer-Encoding: chunked\r\n\r\n2\r\n"
         + body + b"\r\n0\r\n\r\n"),
        ("negative Content-Length", head + b"Content-Length: -5\r\n\r\n" + body),
        ("Content-Length and chunked", head + b"Content-Length: 5\r\nTransfer-Encoding: "
         b"chunked\r\n\r\n" + body),
        ("two Content-Lengths", head + b"Content-Length: 5\r\nContent-Length: 9\r\n\r\n" + body),
        ("1 MB header", head + b"X-Big: " + b"a" * MB + b"\r\n\r\n"),
        ("header name with a space", head + b"Bad Header: x\r\n\r\n"),
        ("TLS ClientHello to the plain port", tls_hello),
        ("garbage request line", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n"),
        ("HTTP/9.9", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n"),
    ]
    return [Case("malformed HTTP", name, raw, http_layer=True) for name, raw in cases]


def cases() -> list[Case]:
    return (_int_cases() + _text_cases() + _type_cases() + _float_cases() + _nesting_cases()
            + _size_cases() + _json_cases() + _http_cases())


# ---------------------------------------------------------------- the client


def exchange(port: int, raw: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    """Sends raw (stopping early if the server closes), returns (status, body); status 0 when
    the connection closed with no answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            view = memoryview(raw)
            for start in range(0, len(raw), SEND_CHUNK):
                sock.sendall(view[start:start + SEND_CHUNK])
            # No shutdown(SHUT_WR): uvicorn takes the half-close for a client gone, and drops
            # the answer of a request still running.
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered before the body was sent whole: read what it said
        data = bytearray()
        try:
            while chunk := sock.recv(1 << 16):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return 0, b""
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(parts[1]), body


def _dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


def is_error_object(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
        return bool(error["message"]) and bool(error["type"]) and "param" in error
    except (ValueError, KeyError, TypeError):
        return False


def stream_once(port: int, tokens: int) -> tuple[str, float]:
    """One greedy streamed completion: (its text, the worst gap between two chunks)."""
    body = json.dumps({**GREEDY, "max_tokens": tokens, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(http_request("/v1/completions", body))
        reader = sock.makefile("rb")
        texts, last, worst = [], None, 0.0
        for line in reader:
            if not line.startswith(b"data: {"):
                if line.startswith(b"data: [DONE]"):
                    break
                continue
            now = time.perf_counter()
            if last is not None:
                worst = max(worst, now - last)
            last = now
            choices = json.loads(line[6:])["choices"]  # KeyError: an error event
            texts += [c["text"] for c in choices]
    return "".join(texts), worst


class Streams(threading.Thread):
    """Greedy streams one after another until stopped: their texts and worst gap."""

    def __init__(self, port: int, tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.tokens = port, tokens
        self.texts: list[str] = []
        self.worst_gap = 0.0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                text, gap = stream_once(self.port, self.tokens)
            except (OSError, ValueError, KeyError) as e:  # an error event, a dead server
                self.texts.append(f"<the stream failed: {e!r}>")
                return
            self.texts.append(text)
            self.worst_gap = max(self.worst_gap, gap)


class RssSampler(threading.Thread):
    """The server's process group's resident memory, every 20 ms: the peak since reset()."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.stopping = threading.Event()

    def current(self) -> int:
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def reset(self) -> None:
        self.peak = self.current()

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            self.peak = max(self.peak, self.current())


# ---------------------------------------------------------------- the run


def healthy(port: int) -> bool:
    return exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"\r\n", timeout=30)[0] == 200


def measure(args: argparse.Namespace) -> dict[str, Any]:
    table = cases()  # built before any measurement: the client's own work stays out of it
    serve_args = ["--dtype", args.dtype, "--kv-cache-memory", "128M", *args.serve_args.split()]
    if args.model:
        serve_args += ["--model", args.model]
    server = ServeProcess(*serve_args, startup_timeout_s=600)
    port = server.http_port
    try:
        reference, _ = stream_once(port, args.stream_tokens)  # warm-up
        idle = Streams(port, args.stream_tokens)
        idle.start()
        while len(idle.texts) < 3:
            time.sleep(0.05)
        idle.stopping.set()
        idle.join()
        rss = RssSampler(server.process.pid)
        baseline = rss.current()
        rss.start()
        busy = Streams(port, args.stream_tokens)
        busy.start()
        outcomes = []
        for case in table:
            rss.reset()
            started = time.perf_counter()
            status, body = exchange(port, case.request, 5 if case.http_layer else 120)
            seconds = time.perf_counter() - started
            outcomes.append(Outcome(case, status, is_error_object(body), seconds,
                                    max(0, rss.peak - baseline)))
        busy.stopping.set()
        busy.join()
        rss.stopping.set()
        alive = healthy(port)
        after, _ = stream_once(port, args.stream_tokens)
    finally:
        server.stop()
    texts = [*idle.texts, *busy.texts, after]
    return {"outcomes": outcomes, "idle_gap_s": idle.worst_gap, "busy_gap_s": busy.worst_gap,
            "busy_streams": len(busy.texts), "alive": alive,
            "greedy_unchanged": all(t == reference for t in texts),
            "baseline_rss": baseline}


def verdict(result: dict[str, Any]) -> dict[str, bool]:
    app = [o for o in result["outcomes"] if not o.case.http_layer]
    peak = max(o.rss_growth for o in result["outcomes"])
    return {
        "no 5xx": all(o.status < 500 for o in result["outcomes"]),
        "every application 4xx is an error object": all(
            o.error_object for o in app if 400 <= o.status < 500),
        "every application case answered": all(o.status for o in app),
        "server alive, greedy text unchanged": result["alive"] and result["greedy_unchanged"],
        "peak RSS growth < 300 MB": peak < RSS_BAR_BYTES,
        "worst gap < 5x idle + 0.2 s": result["busy_gap_s"] < 5 * result["idle_gap_s"] + 0.2,
    }


def group_table(cases: list[dict[str, Any]]) -> list[str]:
    """One row per group of the saved cases (hostile-http.json's): statuses, error objects,
    the slowest answer and the largest RSS growth."""
    lines = ["| group | cases | statuses | 4xx with an error object | slowest s | RSS growth MB |",
             "|---|---|---|---|---|---|"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(c)
    for group, members in groups.items():
        counts: dict[int, int] = {}
        for c in members:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        statuses = ", ".join(f"{n}x {s or 'closed'}" for s, n in sorted(counts.items()))
        four = [c for c in members if 400 <= c["status"] < 500]
        objects = f"{sum(c['error_object'] for c in four)}/{len(four)}"
        lines.append(f"| {group} | {len(members)} | {statuses} | {objects} | "
                     f"{max(c['seconds'] for c in members):.2f} | "
                     f"{max(c['rss_growth_bytes'] for c in members) / MB:.0f} |")
    return lines


def as_dicts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [{"group": o.case.group, "case": o.case.name, "status": o.status,
             "error_object": o.error_object, "http_layer": o.case.http_layer,
             "seconds": o.seconds, "rss_growth_bytes": o.rss_growth} for o in outcomes]


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = ["| group | case | status | error object | s | RSS growth MB |",
             "|---|---|---|---|---|---|"]
    for o in result["outcomes"]:
        obj = "yes" if o.error_object else ("plain text" if o.status else "-")
        lines.append(f"| {o.case.group} | {o.case.name} | {o.status or 'closed'} | {obj} | "
                     f"{o.seconds:.2f} | {o.rss_growth / MB:.0f} |")
    statuses: dict[int, int] = {}
    for o in result["outcomes"]:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    peak = max(result["outcomes"], key=lambda o: o.rss_growth)
    counts = ", ".join(f"{s or 'closed'}: {n}" for s, n in sorted(statuses.items()))
    lines += ["", *group_table(as_dicts(result["outcomes"])), "",
              f"cases: {len(result['outcomes'])}; statuses: {counts}",
              f"greedy stream worst gap: idle {result['idle_gap_s']:.3f} s, during the table "
              f"{result['busy_gap_s']:.3f} s ({result['busy_streams']} streams; bar "
              f"{5 * result['idle_gap_s'] + 0.2:.3f} s)",
              f"server RSS: baseline {result['baseline_rss'] / MB:.0f} MB, peak growth "
              f"{peak.rss_growth / MB:.0f} MB (during '{peak.case.name}')", ""]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in verdict(result).items()]
    return lines


def run(args: argparse.Namespace) -> None:
    result = measure(args)
    lines = report(result, args)
    print("\n".join(lines), flush=True)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    checks = verdict(result)
    summary = {
        "cases": as_dicts(result["outcomes"]),
        **{k: result[k] for k in ("idle_gap_s", "busy_gap_s", "busy_streams", "alive",
                                  "greedy_unchanged", "baseline_rss")},
        "checks": checks}
    (Path(args.results) / "hostile-http.json").write_text(json.dumps(summary, indent=1))
    correctness = [k for k in checks if "RSS" not in k and "gap" not in k]
    if not all(checks[k] for k in correctness):
        raise SystemExit(1)

