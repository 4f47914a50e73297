"""Where bfloat16 costs top-1 agreement: the default model in float32 (the file's weights
de-quantised, the reference of tests/worker/test_quantized_quality.py), teacher forced over the
quality text, with one kind of value rounded to bfloat16 at a time: every linear layer's
weights, its inputs, its outputs (the LM head's apart from the rest). Each row is the top-1
agreement and mean KL against the unrounded model: what that rounding alone costs. The evidence
for worker_svc/native/head.h (the LM head's logits of steps of more rows).

    .venv/bin/python -m batchwire.benchmarks.offline.rounding_budget --windows 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import torch
from batchwire.benchmarks.offline.prefill_paths import prefill_metadata
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from torch import nn

TEXT = os.path.join("tests", "worker", "data", "quality_text.txt")
WINDOW = 346  # the quality test's windows: the text in 8 parts, each from position 0


def bfloat16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@contextlib.contextmanager
def rounded(linears: list[nn.Linear], part: str) -> Iterator[None]:
    """Within: `part` ("weights", "inputs", "outputs", "head output", "layer outputs") of the
    linear layers (the last is the LM head) rounded to bfloat16."""
    hooks, saved = [], [m.weight.data.clone() for m in linears]
    head, layers = linears[-1:], linears[:-1]
    if part == "weights":
        for m in linears:
            m.weight.data.copy_(bfloat16(m.weight.data))
    elif part == "inputs":
        hooks = [m.register_forward_pre_hook(lambda _, args: (bfloat16(args[0]),)) for m in linears]
    else:
        chosen = {"outputs": linears, "head output": head, "layer outputs": layers}[part]
        hooks = [m.register_forward_hook(lambda _, args, out: bfloat16(out)) for m in chosen]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for m, weight in zip(linears, saved, strict=True):
            m.weight.data.copy_(weight)


def agreement(reference: list[torch.Tensor], ours: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || ours) in nats) over every position of the
    windows' log-probabilities."""
    agree, kl, count = 0, 0.0, 0
    for ref, mine in zip(reference, ours, strict=True):
        agree += int((ref.argmax(-1) == mine.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - mine)).sum())
        count += ref.shape[0]
    return agree / count, kl / count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsSaid,
    )
    parser.add_argument("--text", default=TEXT, help="the text, read from the repository")
    parser.add_argument(
        "--windows",
        type=int,
        default=3,
        help=f"windows of {WINDOW} tokens of the text, each from position 0",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    return parser


def main() -> None:
    from batchwire.common.worker_config import WorkerConfig

    from scheduler_svc.core.tokenizer import load_tokenizer
    from worker_svc.models.forward_context import set_forward_context
    from worker_svc.runner.worker import Worker

    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    with open(args.text) as f:
        ids = load_tokenizer(None)(f.read()).input_ids
    windows = [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(args.windows)]
    worker = Worker(
        WorkerConfig(
            dtype="float32",
            quantization="none",
            kv_cache_memory_bytes=256 << 20,
            max_num_reqs=4,
            max_model_len=1024,
            max_num_batched_tokens=1024,
        )
    )
    model = worker.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears[-1] is model.lm_head, "the LM head is the last linear layer"

    def logprobs() -> list[torch.Tensor]:
        out = []
        for window in windows:
            metadata = prefill_metadata([len(window)], worker.config.block_size)
            with torch.inference_mode(), set_forward_context(metadata):
                hidden = model(torch.tensor(window), torch.arange(len(window)))
                out.append(torch.log_softmax(model.compute_logits(hidden), dim=-1))
        return out

    reference = logprobs()
    print(
        f"{worker.get_info().weights}; {len(windows)} windows of {WINDOW} tokens, teacher "
        "forced, against the same model unrounded"
    )
    print("| rounded to bfloat16 | top-1 agreement | mean KL (nats) |\n|---|---|---|")
    for part in ("weights", "inputs", "layer outputs", "head output", "outputs"):
        with rounded(linears, part):
            top1, kl = agreement(reference, logprobs())
        print(f"| {part} | {top1:.4f} | {kl:.5f} |", flush=True)


if __name__ == "__main__":
    main()
