"""The worker on a CUDA device: greedy parity with transformers, then decode step time per backend.

    PYTHONPATH=.:protos python3 benchmarks/worker_gpu.py     # on a CUDA machine

1. Tiny random Llama / Qwen2 / Qwen3 checkpoints (head_dim 64, the Triton kernels' shapes) run
   through the real ModelRunner on CUDA in float32 with the Triton kernels, driven by hand-built
   SchedulerOutputs (chunked prefill, requests joining mid-run); their greedy tokens must equal
   transformers' on the CPU, up to the near-tie rule of tests/parity.py.
2. A SmolLM2-135M-shaped random model (30 layers, 9 query / 3 KV heads, bfloat16): median time of
   a decode step of 64 requests with 512 tokens of context, Triton kernels against the torch path
   on the same GPU, and the greedy tokens of both backends compared.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchwire.common.worker_config import WorkerConfig  # noqa: E402

from tests.parity import assert_greedy_parity, hf_greedy  # noqa: E402
from tests.worker.step_driver import StepDriver, greedy  # noqa: E402
from worker_svc.worker import Worker  # noqa: E402

TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    initializer_range=0.3, tie_word_embeddings=False,
)  # fmt: skip
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # fmt: skip
DEVICE = "cuda"
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def save_checkpoint(directory: str, arch: str, **shape) -> str:
    torch.manual_seed(0)
    config = CONFIGS[arch](**shape)
    if arch == "qwen3":
        config.head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    return directory


def make_worker(path: str, dtype: str, backend: str, **overrides) -> Worker:
    settings = dict(
        model=path, dtype=dtype, device=DEVICE, attention_backend=backend, block_size=16,
        kv_cache_memory_bytes=1 << 30, max_num_reqs=128, max_model_len=2048,
        max_num_batched_tokens=4096,
    )  # fmt: skip
    return Worker(WorkerConfig(**{**settings, **overrides}))


def drive(
    worker: Worker, prompts: dict[str, list[int]], max_tokens: int, chunk: int, eos: list[int]
):
    """Half the requests start, three steps later the rest join: mixed prefill + decode steps."""
    sampling = greedy()
    sampling.min_tokens = max_tokens
    sampling.stop_token_ids.extend(eos)  # masked until max_tokens, as hf_greedy's min_new_tokens
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=chunk)
    ids = list(prompts)
    for r in ids[: len(ids) // 2]:
        driver.add(r, prompts[r], max_tokens, sampling)
    for _ in range(3):
        driver.step()
    for r in ids[len(ids) // 2 :]:
        driver.add(r, prompts[r], max_tokens, sampling)
    return driver.run()


def parity(tmp: str) -> bool:
    gen = torch.Generator().manual_seed(1)
    prompts = {
        f"r{i}": torch.randint(3, 512, (n,), generator=gen).tolist()
        for i, n in enumerate([5, 23, 41, 16, 100, 7, 64, 300])
    }
    ok = True
    for arch in CONFIGS:
        path = save_checkpoint(f"{tmp}/{arch}", arch, **TINY)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        eos = hf.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        worker = make_worker(path, "float32", "triton")
        ours = drive(worker, prompts, max_tokens=16, chunk=24, eos=eos)
        notes = []
        for r, prompt in prompts.items():
            try:
                note = assert_greedy_parity(hf, prompt, ours[r], hf_greedy(hf, prompt, 16))
            except AssertionError as e:
                ok, note = False, f"FAIL {e}"
            if note:
                notes.append(f"{r}: {note}")
        print(
            f"parity {arch:6s} float32 triton on cuda vs transformers on cpu: "
            f"{len(prompts) - len(notes)}/{len(prompts)} identical",
            *notes,
            sep="\n  ",
        )
    return ok


def decode_step_ms(worker: Worker, num_reqs: int, context: int, steps: int) -> tuple[float, dict]:
    gen = torch.Generator().manual_seed(2)
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=4096)
    vocab = worker.runner.vocab_size
    for i in range(num_reqs):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        driver.add(f"d{i}", prompt, steps + 8)
    for _ in range(4):  # the prefill step(s) and warm-up decode steps, not timed
        driver.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        driver.step()  # ends in .tolist() of the sampled ids: synchronised
        times.append(time.perf_counter() - start)
    tokens = {r.req_id: list(r.output) for r in driver.active.values()}
    return statistics.median(times) * 1e3, tokens


def decode_speed(tmp: str) -> None:
    path = save_checkpoint(f"{tmp}/smollm2_shape", "llama", **SMOLLM2_SHAPE)
    results = {}
    for backend in ("triton", "torch"):
        # One step prefills all 64 prompts; the cache holds 64 x (512 + 28) tokens x 30 layers.
        worker = make_worker(
            path,
            "bfloat16",
            backend,
            max_num_batched_tokens=64 * 512,
            kv_cache_memory_bytes=4 << 30,
        )
        results[backend] = decode_step_ms(worker, num_reqs=64, context=512, steps=20)
        del worker
        torch.cuda.empty_cache()
    (t_ms, t_tok), (p_ms, p_tok) = results["triton"], results["torch"]
    same = sum(t_tok[r] == p_tok[r] for r in t_tok)
    print(
        f"decode step, SmolLM2-135M shape bf16, 64 requests x 512 context, median of 20: "
        f"triton {t_ms:.2f} ms, torch path {p_ms:.2f} ms -> {p_ms / t_ms:.2f}x; "
        f"identical greedy outputs {same}/{len(t_tok)}"
    )


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        ok = parity(tmp)
        decode_speed(tmp)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
