"""Where one engine step's time goes: one W64 run on the in-process worker with time.perf_counter
around each part of the step (scheduler, runner inputs, attention, the rest of the model, LM head,
sampling). Timing wrappers add a few microseconds per call, so the run is not one of the timed ones.
"""

from __future__ import annotations

from typing import Any

from batchwire.benchmarks.offline.offline_w64 import run_batchwire
from batchwire.benchmarks.shared.splits import Splits
from batchwire.benchmarks.shared.workloads import Workload

import worker_svc.runner.model_runner as model_runner_module
from worker_svc.models.step_ops import StepTables

# Part of the step -> what a reader of the table should take it to mean.
PARTS = {
    "scheduler": "schedule(), grammar bitmask, update_from_output() (token stop checks)",
    "runner inputs": "validation, _update_states (persistent batch), _prepare_inputs",
    "attention": "the K/V cache write + paged attention, all layers (with the native step: "
                 "rotary too; its one call for a few decode rows counts as model, rest)",
    "model, rest": "forward pass less attention: matmuls, norms, rotary, activations",
    "LM head": "logits of the sampled rows",
    "sampling": "sampler and recording the sampled tokens",
    "engine loop, other": "the rest of LLM.generate: the loop, the output processor (text, "
                          "stop strings), Python",
}


def profile_step(llm: Any, workload: Workload) -> dict[str, Any]:
    """Seconds per part over one whole run of the workload on llm (an in-process `uni` LLM)."""
    scheduler, runner = llm.engine.scheduler, llm.engine.executor.worker.runner
    model = runner.model
    splits = Splits()
    for name in ("schedule", "get_grammar_bitmask", "update_from_output"):
        splits.wrap(scheduler, name, "scheduler")
    splits.wrap(model_runner_module, "validate_scheduler_output", "runner inputs")
    splits.wrap(runner, "_update_states", "runner inputs")
    splits.wrap(runner, "_prepare_inputs", "runner inputs")
    # The cache write and the attention kernel as the layers call them: the write through the
    # step's tables, the kernel through each layer's `attend` (bound when the layer was built).
    splits.wrap(StepTables, "write_kv", "attention")
    for layer in model.attention_layers():
        splits.wrap(layer, "attend", "attention")
    native = getattr(model, "native", None)
    if native is not None:  # the native step's C call from q|k|v to attention's output
        splits.wrap(native.lib, "bw_attend_qkv", "attention")
    splits.wrap(model, "forward", "model, rest")
    splits.wrap(model, "compute_logits", "LM head")
    splits.wrap(runner, "sampler", "sampling")
    splits.wrap(runner, "_record_sampled", "sampling")
    steps_before = scheduler.stats.num_steps
    try:
        total = run_batchwire(llm, workload)
    finally:
        splits.undo()
    seconds = dict(splits.seconds)
    seconds["model, rest"] -= seconds.get("attention", 0.0)  # attention runs inside forward
    seconds["engine loop, other"] = total - sum(seconds.values())
    steps = scheduler.stats.num_steps - steps_before
    return {"total_s": total, "steps": steps,
            "parts": {p: {"seconds": seconds.get(p, 0.0), "ms_per_step": 1e3 * seconds.get(p, 0.0)
                          / steps, "share": seconds.get(p, 0.0) / total} for p in PARTS}}
