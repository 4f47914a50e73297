"""The worker's configuration: one frozen dataclass, validated once at start-up.

It lives here, without torch, because the scheduler builds one for the workers it starts itself
(`to_argv` gives the `python -m worker_svc` options that recreate it in the child).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("bfloat16", "float16", "float32")
TASKS = ("generate", "embed")
POOLING_TYPES = ("last", "mean", "cls")
# How linear weights are served (worker_svc/quant): "auto" = a GGUF file's Q4_0/Q4_1/Q8_0 tensors
# as they are stored (int4 / int8 kernels) where the serving dtype is bfloat16 on CPU, else as
# "none"; "none" = de-quantised to the serving dtype (the reference); "int8"/"int4" = every
# linear weight in that form, float weights quantized at load (a GGUF tensor stored in more bits
# than int4, Q8_0, is served as int8 by int4: never fewer bits than the file holds).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# How a CPU worker runs its steps: "native" = up to 8 decode rows in one call into a compiled C
# step (worker_svc/native), any other step with torch's products and the rest of each layer in
# C, where the linear weights are served quantized (as stored), falling back to torch where it
# cannot or would be slower (no C compiler, neither VNNI nor AVX2, float weights, a sharded
# model, a step with adapters); "torch" = every step on the torch path (the reference).
CPU_DECODES = ("native", "torch")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str | None = None  # checkpoint dir or .gguf file; None = the embedded SmolLM2
    dtype: str = "bfloat16"  # bfloat16 matmuls run ~6x faster than float32 on AMX CPUs
    device: str = "cpu"
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_bytes: int = 1 << 30  # budget for all layers' K and V together
    max_num_reqs: int = 256  # rows of the persistent batch
    max_model_len: int = 2048  # longest sequence (prompt + output) a request may reach
    # Most tokens one step may schedule; the scheduler's default too (SchedulerConfig), and the
    # engine runs with the smaller of the two that GetInfo reports.
    max_num_batched_tokens: int = 2048
    max_logprobs: int = 20
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, torch on CPU), "torch", "triton"
    tensor_parallel_size: int = 1  # ranks that shard each pipeline stage's layers together
    pipeline_parallel_size: int = 1  # stages the layers are split into, one after the other
    # This worker's global rank in the group of pipeline x tensor ranks: stage-major, so the
    # ranks of one stage are neighbours (rank = pp_rank * tensor_parallel_size + tp_rank).
    rank: int = 0
    distributed_init_method: str = "tcp://127.0.0.1:29500"  # rendezvous of the group's ranks
    task: str = "generate"  # "generate" samples tokens; "embed" returns pooled hidden states
    # A causal model's last token is the only one that has seen the whole input, so "last" is
    # what decoder embedding models use; it also needs no state across prefill chunks.
    pooling_type: str = "last"
    normalize: bool = True  # L2-normalise pooled vectors (cosine similarity = dot product)
    # Each request's tokens and logprobs bit for bit independent of the rest of its batches,
    # its prefill chunking and prefix-cache hits (worker_svc/batch_invariant), at a cost in speed.
    batch_invariant: bool = False
    # LoRA adapter slots in the model: the most adapters one step may mix; 0 serves none and
    # adds no work to a step.
    max_loras: int = 0
    max_lora_rank: int = 16  # the slots' rank: every adapter's rank must be at most this
    max_cpu_loras: int = 0  # adapters kept on the host (LRU); 0 = as many as max_loras
    quantization: str = "auto"  # one of QUANTIZATIONS
    cpu_decode: str = "native"  # one of CPU_DECODES

    @property
    def served_quantization(self) -> str:
        """What the loader does: "none", "native" (auto where its kernels run), "int8", "int4"."""
        if self.quantization == "auto":
            # float32 stays de-quantised: it is the dtype of the parity tests against transformers.
            return "native" if self._quantized_kernels_run() is None else "none"
        return self.quantization

    def _quantized_kernels_run(self) -> str | None:
        """Why the quantized kernels cannot serve this configuration; None when they can."""
        if self.dtype != "bfloat16":
            # torch's int4 kernel has a float32 path, but a slow one: 1.2 s for a [960 x 576] x
            # [576 x 576] matmul here, against 33 ms in bfloat16.
            return f"dtype={self.dtype} (they compute in bfloat16)"
        if self.device != "cpu":
            return f"device={self.device} (they are CPU kernels)"
        if self.tensor_parallel_size > 1:
            return f"tensor_parallel_size={self.tensor_parallel_size} (weights are not sharded)"
        if self.batch_invariant:
            return "batch_invariant=True (their matmuls are not row-tiled)"
        return None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_reqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, pipeline_parallel_size x tensor_parallel_size = "
                f"{self.world_size}), got {self.rank}"
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        for name in ("max_loras", "max_cpu_loras"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        # Option names as well as fields: `batchwire serve` and `batchwire worker` print these.
        if self.max_loras and self.tensor_parallel_size > 1:
            raise ValueError(
                f"max_loras={self.max_loras} (--max-loras): LoRA adapters are served without "
                f"tensor parallelism only, got tensor_parallel_size={self.tensor_parallel_size} "
                "(--tensor-parallel-size)"
            )
        if self.max_loras and self.batch_invariant:
            # The adapters' matmuls are not row-tiled: a row's result would depend on its batch.
            raise ValueError(
                f"max_loras={self.max_loras} (--max-loras): LoRA adapters are not served in "
                "batch-invariant mode (batch_invariant=True, --batch-invariant)"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.cpu_decode not in CPU_DECODES:
            raise ValueError(f"cpu_decode must be one of {CPU_DECODES}, got {self.cpu_decode!r}")
        refused = self._quantized_kernels_run()
        if self.quantization in ("int8", "int4") and refused is not None:
            raise ValueError(f"quantization={self.quantization} is not served with {refused}; "
                             "use quantization=auto or none")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def output_rank(self) -> int:
        """TP rank 0 of the last stage: the one rank whose replies carry the step's output."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

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
            "--pipeline-parallel-size", str(self.pipeline_parallel_size),
            "--task", self.task, "--pooling-type", self.pooling_type,
            "--normalize" if self.normalize else "--no-normalize",
            "--batch-invariant" if self.batch_invariant else "--no-batch-invariant",
            "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
            "--max-cpu-loras", str(self.max_cpu_loras), "--quantization", self.quantization,
            "--cpu-decode", self.cpu_decode,
        ]
        if self.model is not None:
            argv += ["--model", self.model]
        return argv
