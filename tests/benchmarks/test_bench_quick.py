"""`batchwire bench all --quick` runs every benchmark end to end and leaves sane results behind.
Nothing here is about speed: only that the code runs and its files hold what a reader expects."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAMES = ("throughput", "serve", "step", "prefix", "spec", "overhead", "soak", "chaos", "lora")


def test_bench_all_quick(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scheduler_svc.cli", "bench", "all", "--quick", "--threads", "1",
           "--results", str(tmp_path)]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as e:  # say where it stood, not only that it hung
        tail = [(x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-2000:]
                for x in (e.stdout, e.stderr)]
        pytest.fail("bench all --quick ran past 400 s; its output ended with:\n" + "\n".join(tail))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {}
    for name in NAMES:
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        results[name] = data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["benchmark"] == name and data["tables"]
        assert {"cpu", "cores", "torch", "dtype", "torch_threads"} <= data["machine"].keys()
        assert all(t["rows"] for t in data["tables"])
        # A quick run says so everywhere, and reports no speed ratio that could pass for a result.
        assert data["quick"] is True and data["notice"].startswith("QUICK RUN")
        assert all(t["title"].startswith("[quick run] ") for t in data["tables"]), name
        assert "ratios" not in data, name
        for t in data["tables"]:
            assert "vs best peer" not in t["columns"] and "x" not in t["columns"], t["title"]
            assert not any(re.fullmatch(r"[\d.]+x", cell) for row in t["rows"] for cell in row)
    assert "best peer" not in done.stdout.replace("best peer:", "")
    assert done.stdout.count("QUICK RUN (--quick)") == len(NAMES)

    lora = results["lora"]["results"]  # both runs of the same worker produced their tokens
    assert lora["base"]["median"] > 0 and lora["4 adapters"]["median"] > 0

    soak = results["soak"]  # a quick soak still checks what a long one is for
    load = [s for s in soak["samples"] if not s.get("idle")]
    assert len(load) >= 3 and sum(s["done"] for s in load) > 0
    assert sum(s["cancelled"] for s in load) > 0, "the mix cancels a fifth of its requests"
    assert not [e for s in soak["samples"] for e in s["errors"]]
    assert all(s["rss_mib"] > 0 and s["fds"] > 0 for s in soak["samples"])
    assert soak["idle_kv_blocks_used"] == 0  # cancelled streams freed their blocks too

    chaos = results["chaos"]  # a quick chaos loop still checks every request it ran
    assert [e["action"] for e in chaos["events"]][:2] == ["kill", "stop"]
    assert {"kill", "stop", "thaw", "drain"} <= {e["action"] for e in chaos["events"]}
    assert chaos["num_requests"] > 0 and not chaos["errors"]
    assert chaos["finished_once"] == chaos["identical"] == chaos["num_requests"]
    assert chaos["kv_blocks_used_end"] == 0 and chaos["ok"] is True
    assert chaos["new_workers_joined"] >= 1  # the drained one's replacement took over

    throughput = results["throughput"]["results"]
    assert {"batchwire uni", "batchwire zmq", "batchwire grpc", "transformers batch 16",
            "transformers batch 64"} <= throughput.keys()
    for figures in throughput.values():
        assert len(figures["useful_tok_s"]["runs"]) == 2 and figures["useful_tok_s"]["min"] > 0
    assert 0 < results["throughput"]["mfu"]["configs"]["batchwire uni"]["mfu"]
    assert results["throughput"]["skipped"]["llama.cpp"]  # the tiny model has no GGUF file
    parts = results["throughput"]["profile"]["parts"]
    assert parts["attention"]["ms_per_step"] > 0 and parts["sampling"]["ms_per_step"] > 0

    serve = results["serve"]["summary"]
    assert set(serve) == {"8", "inf"}
    for figures in serve.values():
        assert figures["completed"] == 8 and figures["failed"] == 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < figures[metric]["p50"] <= figures[metric]["p99"]

    assert "transport zmq" in results["step"]["results"]
    assert results["prefix"]["results"]["shared, cache on"]["ttft"]["median"] > 0

    spec = results["spec"]
    assert {"1 stream, off", "1 stream, K=2", "4 streams, off", "4 streams, K=2"} <= set(
        spec["results"])
    assert spec["results"]["1 stream, off"]["acceptance"]["median"] == 0
    assert 0 <= spec["results"]["4 streams, K=2"]["acceptance"]["median"] <= 1
    assert spec["w64"]["K=4"]["median"] > 0 and spec["w64"]["off"]["median"] > 0
    assert all(v["off"] > 0 and v["on"] > 0 for v in spec["scheduler_step_ms"].values())

    overhead = results["overhead"]
    assert overhead["step_ms"]["uni, 16"]["median"] > 0
    assert overhead["bare_forward_ms"]["16"]["median"] > 0
    assert list(overhead["step_ms"]) == ["uni, 16", "zmq async, 16"]
    # Over ZMQ, the step's two sides apart: the worker's busy time read from its /metrics, the
    # engine's own (the step less its waits on the worker); both real and inside the step.
    sides = overhead["remote_sides_ms"]["zmq async, 16"]
    assert len(sides["step"]) == len(sides["worker"]) == 2  # a figure per repeat
    for step, wait, engine, worker in zip(sides["step"], sides["wait"], sides["engine"],
                                          sides["worker"], strict=True):
        assert 0 < wait < step and 0 < engine < step
        # The worker works inside the steps, plus at most the step in flight when the timing
        # started (async scheduling), a step in 8: never more than 1/8 over.
        assert 0 < worker < 1.2 * step
        assert abs(engine + wait - step) < 1e-6
    assert "waiting on the worker" in overhead["parts"]["zmq async, 16"]
    assert any(t["title"].startswith("[quick run] async scheduling: the step against")
               for t in overhead["tables"])
    uni_parts = overhead["parts"]["uni, 16"]
    assert uni_parts["forward"] > 0 and uni_parts["schedule()"] > 0
    assert uni_parts["detokenization"] > 0  # the model's ids decode with the default tokenizer

