"""The worker on a CUDA device: greedy parity with transformers, then decode step time per backend.

    PYTHONPATH=.:protos python3 benchmarks/gpu/worker_gpu.py     # on a CUDA machine

1. Tiny random Llama / Qwen2 / Qwen3 checkpoints (head_dim 64, the Triton kernels' shapes) run
   through the real ModelRunner on CUDA in float32 with the Triton kernels, driven by hand-built
   SchedulerOutputs (chunked prefill, requests joining mid-run); their greedy tokens must equal
   transformers' on the CPU, up to the near-tie rule of tests/parity.py.
2. The staging of a step's inputs (worker_svc/batch/staging.py): the runner's host input buffers are
   pinned, every host-to-device copy of a step is non_blocking, and the greedy tokens of a run of
   a few hundred steps, the next step's inputs written while the last step's copies may still be
   in flight (fenced by the input event), equal those of a run that synchronizes after every copy.
   `--staging-only --device cpu` runs this part on a machine without a GPU: there nothing is
   pinned and nothing copied, which it checks too (it is how the script's own code is tried).
3. A SmolLM2-135M-shaped random model (30 layers, 9 query / 3 KV heads, bfloat16): median time of
   a decode step of 64 requests with 512 tokens of context, Triton kernels against the torch path
   on the same GPU, and the greedy tokens of both backends compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.common.worker_config import WorkerConfig  # noqa: E402

from tests.parity import assert_greedy_parity, hf_greedy  # noqa: E402
from tests.worker.step_driver import StepDriver, greedy  # noqa: E402
from worker_svc.runner.worker import Worker  # noqa: E402

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


def staging_buffers(worker: Worker) -> dict[str, torch.Tensor]:
    """The host buffers a step's inputs are laid out in and copied to the device from."""
    runner = worker.runner
    table = runner.input_batch.block_table
    return {
        "input_ids": runner.input_ids,
        "positions": runner.positions,
        "query_start_loc": torch.from_numpy(runner.query_start_loc_np),
        "seq_lens": torch.from_numpy(runner.seq_lens_np),
        "block_table": table.table,
        "slot_mapping": table.slot_mapping,
    }


class CopyLog:
    """Every host-to-device Tensor.to of one step: (source pinned, non_blocking, shape)."""

    def __init__(self) -> None:
        self.copies: list[tuple[bool, bool, tuple[int, ...]]] = []
        self._to = torch.Tensor.to

    def __enter__(self) -> CopyLog:
        original, copies = self._to, self.copies

        def logged(tensor: torch.Tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and out.device.type != "cpu":
                copies.append((tensor.is_pinned(), bool(kwargs.get("non_blocking")),
                               tuple(tensor.shape)))
            return out

        torch.Tensor.to = logged  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *_: object) -> None:
        torch.Tensor.to = self._to  # type: ignore[method-assign]


def synchronized_copies(worker: Worker) -> None:
    """The reference: each input copied and waited for at once, so no copy is in flight when
    the host writes the next step's inputs (the fence then has nothing to guard)."""
    runner = worker.runner
    device = runner.device

    def on_device(host: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":
            return host
        out = host.to(device)
        torch.cuda.synchronize(device)
        return out

    runner._on_device = on_device  # type: ignore[method-assign]


def staging(tmp: str, device: str, backend: str) -> bool:
    path = save_checkpoint(f"{tmp}/staging", "llama", **TINY)
    on_gpu = device != "cpu"
    small = dict(device=device, kv_cache_memory_bytes=64 << 20)
    worker = make_worker(path, "float32", backend, **small)
    buffers = staging_buffers(worker)
    pinned = {name: t.is_pinned() for name, t in buffers.items()}
    ok = all(pinned.values()) if on_gpu else not any(pinned.values())
    print(f"staging on {device}: host buffers pinned: {pinned} "
          f"({'all expected' if on_gpu else 'none expected'}) -> {'ok' if ok else 'FAIL'}")

    gen = torch.Generator().manual_seed(3)
    prompts = {f"s{i}": torch.randint(3, 512, (n,), generator=gen).tolist()
               for i, n in enumerate([3, 40, 17, 120, 9, 64, 33, 250])}
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=48)
    for r, prompt in prompts.items():
        driver.add(r, prompt, 300)
    steps = 0
    for _ in range(6):  # prefill chunks and the first decode steps
        driver.step()
        steps += 1
    with CopyLog() as log:
        driver.step()
        steps += 1
    blocking = [c for c in log.copies if not c[1]]
    pageable = [c for c in log.copies if not c[0]]
    copies_ok = not blocking if on_gpu else not log.copies
    print(f"  one step's host-to-device copies: {len(log.copies)}, of which blocking "
          f"{len(blocking)}, from pageable memory {len(pageable)} (shapes "
          f"{[c[2] for c in pageable]}) -> {'ok' if copies_ok else 'FAIL'}")
    while driver.active:
        driver.step()
        steps += 1
    fenced = dict(driver.results)

    reference = make_worker(path, "float32", backend, **small)
    synchronized_copies(reference)
    ref_driver = StepDriver(reference.runner, reference.num_blocks, 16, chunk=48)
    for r, prompt in prompts.items():
        ref_driver.add(r, prompt, 300)
    synced = ref_driver.run()
    same = sum(fenced.get(r) == synced.get(r) for r in prompts)
    tokens_ok = same == len(prompts) and all(len(synced[r]) == 300 for r in prompts)
    print(f"  {steps} steps, fenced copies vs synchronized after every copy: "
          f"{same}/{len(prompts)} requests' 300 greedy tokens identical -> "
          f"{'ok' if tokens_ok else 'FAIL'}")
    return ok and copies_ok and tokens_ok


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
    p = argparse.ArgumentParser(formatter_class=DefaultsSaid, description=__doc__.split("\n")[0])
    p.add_argument("--device", default=DEVICE, help="cuda (default), or cpu with --staging-only")
    p.add_argument("--staging-only", action="store_true", help="part 2 alone")
    args = p.parse_args()
    on_gpu = args.device != "cpu"
    if on_gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device (the staging check alone runs on a CPU: "
                 "--staging-only --device cpu)")
    if not on_gpu and not args.staging_only:
        sys.exit("--device cpu runs only the staging check: add --staging-only")
    print(torch.cuda.get_device_name() if on_gpu else "cpu", "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        if args.staging_only:
            sys.exit(0 if staging(tmp, args.device, "triton" if on_gpu else "torch") else 1)
        ok = parity(tmp)
        ok = staging(tmp, args.device, "triton") and ok
        decode_speed(tmp)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
