"""Where async scheduling is on when nobody says: a remote worker group generating without
speculative decoding; not in process (the worker computes on the engine's thread), not with
speculative decoding, pipeline stages or pooling; and the flags that force it either way."""

from __future__ import annotations

import pytest
from batchwire.v1 import worker_pb2

from scheduler_svc.cli.commands import build_parser
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.engine_core import scheduler_for


def _info(**fields) -> worker_pb2.WorkerInfo:
    base = dict(vocab_size=512, max_model_len=256, num_blocks=64, block_size=16, max_num_reqs=8,
                task="generate", pipeline_parallel_size=1)
    return worker_pb2.WorkerInfo(**{**base, **fields})


@pytest.mark.parametrize("setting, remote, config, info, on", [
    (None, True, {}, {}, True),
    (None, False, {}, {}, False),
    (None, True, {"speculative_method": "ngram"}, {}, False),
    (None, True, {}, {"pipeline_parallel_size": 2}, False),
    (None, True, {}, {"task": "embed", "pooling_type": "mean", "hidden_size": 64}, False),
    (True, False, {}, {}, True),
    (True, True, {"speculative_method": "ngram"}, {}, True),
    (True, True, {}, {"pipeline_parallel_size": 2}, False),  # stages cannot: they learn tokens
    (False, True, {}, {}, False),
])
def test_async_scheduling_default(setting, remote, config, info, on):
    cfg = SchedulerConfig(async_scheduling=setting, **config)
    assert scheduler_for(cfg, _info(**info), remote=remote).async_scheduling is on


@pytest.mark.parametrize("argv, env, want", [
    ([], None, None), (["--async-scheduling"], None, True), (["--no-async-scheduling"], "1", False),
    ([], "1", True), ([], "off", False),
])
def test_async_scheduling_flags(argv, env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("BATCHWIRE_ASYNC_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("BATCHWIRE_ASYNC_SCHEDULING", env)
    args = build_parser().parse_args(["serve", *argv])
    assert args.async_scheduling is want
