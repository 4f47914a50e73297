"""Where an engine's decode step goes, part by part: timers around the scheduler's calls, the
output processor (text, after the token-level step) and, with the in-process worker, each part
of the worker's step. Timers add a few microseconds per call, so this run is not one of the
timed ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchwire.benchmarks.engine.overhead_remote import RemoteStepTimes
from batchwire.benchmarks.shared.splits import Splits

from scheduler_svc.core.output_processor import OutputProcessor

# Part -> what it holds, for the reader of the table.
PARTS = {
    "schedule()": "the scheduler's decision and the SchedulerOutput it builds",
    "output processing": "update_from_output: tokens appended, token stop checks",
    "detokenization": "the output processor after the token-level step: incremental "
                      "detokenizer, stop strings (a server runs it on its event loop)",
    "validation": "the worker's checks of the SchedulerOutput",
    "runner inputs": "_update_states (persistent batch) and _prepare_inputs",
    "forward": "the model and its LM head",
    "sampling": "the sampler",
    "output recording": "the worker's recording of the sampled tokens and its reply",
    "engine loop, other": "the rest of EngineCore.step: the executor call (with a remote "
                          "worker: encoding the request, decoding the reply), Python",
    "waiting on the worker": "with a remote worker: the transport's send and the waits for the "
                             "replies (the wire and whatever of the worker's step the engine "
                             "did not overlap)",
}


def profile_parts(engine: Any, run: Callable[[Splits], list[float]],
                  remote: RemoteStepTimes | None = None) -> dict[str, float]:
    """ms per step of each part over the timed steps of run(splits), which turns the timers on
    (splits.enabled) around its timed steps only and returns their times (ms); with a remote
    worker, `remote` is what run() times the waits on the worker with."""
    import worker_svc.runner.model_runner as model_runner_module

    scheduler = engine.scheduler
    splits = Splits()
    splits.enabled = False
    splits.wrap(scheduler, "schedule", "schedule()")
    splits.wrap(scheduler, "update_from_output", "output processing")
    splits.wrap(OutputProcessor, "process", "detokenization")
    worker = getattr(engine.executor, "worker", None)
    if worker is not None:  # the in-process worker: its parts too
        runner = worker.runner
        splits.wrap(model_runner_module, "validate_scheduler_output", "validation")
        splits.wrap(runner, "_update_states", "runner inputs")
        splits.wrap(runner, "_prepare_inputs", "runner inputs")
        splits.wrap(runner.model, "forward", "forward")
        splits.wrap(runner.model, "compute_logits", "forward")
        splits.wrap(runner, "sampler", "sampling")
        splits.wrap(runner, "_record_sampled", "output recording")
    try:
        t0 = time.perf_counter()
        times = run(splits)
        assert times, f"no timed step ({time.perf_counter() - t0:.1f} s)"
    finally:
        splits.undo()
    seconds = dict(splits.seconds)
    ms = {p: 1e3 * seconds[p] / len(times) for p in PARTS if p in seconds}
    if remote is not None:
        ms["waiting on the worker"] = remote.measured[0]
    ms["engine loop, other"] = sum(times) / len(times) - sum(ms.values())
    return ms
