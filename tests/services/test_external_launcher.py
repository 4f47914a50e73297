"""The external launcher under real torchrun: TP=2 and PP=2 jobs whose every rank runs the same
LLM, greedy and seeded requests with chunked prefill; every rank's tokens equal the in-process
engine's, and LLM.collective_rpc reaches every rank's worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_svc.engine.llm import LLM
from worker_svc.server.tp_group import free_port

from .torchrun_llm import ENGINE, PROMPTS, sampling

SCRIPT = Path(__file__).with_name("torchrun_llm.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def expected(tiny_llama_with_tokenizer) -> list[list[int]]:
    llm = LLM(tiny_llama_with_tokenizer, **ENGINE)
    try:
        return [r.token_ids for r in llm.generate(PROMPTS, sampling(), use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_every_rank_returns_the_in_process_tokens(tp, pp, expected, tiny_llama_with_tokenizer,
                                                  tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
           tiny_llama_with_tokenizer, str(tp), str(pp), str(tmp_path)]
    # A session of its own: on a timeout the ranks go with torchrun, not left waiting forever.
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp * pp)]
    for rank, got in enumerate(ranks):
        assert got["tokens"] == expected, f"rank {rank}"
    # collective_rpc ran on every rank's own worker: the final norm is on the last stage only.
    holds_norm = [got["rpc"][0] != 0.0 for got in ranks]
    assert holds_norm == [rank >= (pp - 1) * tp for rank in range(tp * pp)]
