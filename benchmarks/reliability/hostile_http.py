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
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from batchwire.benchmarks.reliability.hostile_cases import MB, Case, cases, http_request
from batchwire.benchmarks.shared.serve_process import ServeProcess

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
class Outcome:
    case: Case
    status: int  # 0: the connection closed with no answer
    error_object: bool
    seconds: float
    rss_growth: int  # peak RSS during the case over the baseline, bytes


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

