"""The llama.cpp peer through llama-cpp-python (the optional extra `llamacpp`): the same GGUF file,
run with its own quantised weights, one request after another as its Python API serves them."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from batchwire.benchmarks.shared.workloads import Workload


def skip_reason(model_path: str) -> str | None:
    """Why the peer cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[llamacpp]')"
    if not model_path.endswith(".gguf"):
        return f"llama.cpp needs a GGUF file, and the model is {model_path}"
    return None


def load_llamacpp(model_path: str, n_ctx: int, threads: int) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def run_llamacpp(llm: Any, workload: Workload) -> float:
    """Seconds to run every request greedily to its full output length, EOS ignored."""
    t0 = time.perf_counter()
    for prompt, n in workload:
        tokens = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True)
        for count, _ in enumerate(tokens, start=1):
            if count == n:
                break
    return time.perf_counter() - t0
