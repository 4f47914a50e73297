"""The worker's configuration: one frozen dataclass, validated once at start-up.

It lives here, without torch, because the scheduler builds one for the workers it starts itself
(`to_argv` gives the `python -m worker_svc` options that recreate it in the child).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str | None = None  # checkpoint dir or .gguf file; None = the embedded SmolLM2
    dtype: str = "bfloat16"  # bfloat16 matmuls run ~6x faster than float32 on AMX CPUs
    device: str = "cpu"
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_bytes: int = 1 << 30  # budget for all layers' K and V together
    max_num_reqs: int = 256  # rows of the persistent batch
    max_model_len: int = 2048  # longest sequence (prompt + output) a request may reach
    max_num_batched_tokens: int = 4096  # most tokens one step may schedule
    max_logprobs: int = 20
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, torch on CPU), "torch", "triton"
    tensor_parallel_size: int = 1  # ranks that shard this model together
    rank: int = 0  # this worker's rank in its tensor-parallel group
    distributed_init_method: str = "tcp://127.0.0.1:29500"  # rendezvous of the group's ranks

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_reqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(
                f"rank must be in [0, tensor_parallel_size={self.tensor_parallel_size}), "
                f"got {self.rank}"
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def to_argv(self) -> list[str]:
        """The `python -m worker_svc` options that give a worker this configuration (all but
        the rank and rendezvous, which the group launcher sets per rank)."""
        argv = [
            "--dtype", self.dtype, "--device", self.device,
            "--attention-backend", self.attention_backend,
            "--kv-cache-memory", str(self.kv_cache_memory_bytes),
            "--block-size", str(self.block_size), "--max-num-reqs", str(self.max_num_reqs),
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-logprobs", str(self.max_logprobs), "--seed", str(self.seed),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
        ]
        if self.model is not None:
            argv += ["--model", self.model]
        return argv
