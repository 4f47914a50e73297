"""The scheduler service's configuration: one frozen dataclass, validated once at start-up."""

from __future__ import annotations

import dataclasses

from batchwire.common.tls import ClientTls
from batchwire.common.worker_config import POOLING_TYPES, TASKS, WorkerConfig

POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = (None, "ngram")
# core/tool_calls/formats.py's formats, and "none".
TOOL_CALL_PARSERS = ("smollm2", "hermes", "llama3_json", "none")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's caps on one request's options (SchedulerConfig has their meanings)."""
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    max_token_ids: int = 2048


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # The model and the in-process worker (`uni`); remote workers bring their own settings.
    model: str | None = None  # checkpoint dir or .gguf file; None = the embedded SmolLM2
    dtype: str = "bfloat16"  # bfloat16 matmuls run ~6x faster than float32 on AMX CPUs
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory_bytes: int = 1 << 30  # the worker sizes its block pool from this
    seed: int = 0  # seeds the sampling of requests that bring no seed of their own
    # "uni" (in-process), "grpc", "zmq", or an Executor subclass or its qualified name; "auto":
    # "uni" for one in-process worker, "zmq" (the cheapest transport) when workers are remote.
    executor_backend: str | type = "auto"
    # Remote workers, one entry per worker group (replica): its ranks' "host:port" addresses on
    # the transport's port, comma-separated in rank order. Empty: remote executors start one
    # local group of tensor_parallel_size ranks themselves.
    worker_addresses: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # ranks of each pipeline stage of a locally started group
    pipeline_parallel_size: int = 1  # stages of a locally started group (P x T ranks in all)
    # What a locally started group serves: "generate", or "embed" (pooled hidden states). Remote
    # workers report their own task, and the scheduler serves that one.
    task: str = "generate"
    pooling_type: str = "last"  # "last", "mean" or "cls" (embed only)
    normalize: bool = True  # L2-normalise embeddings unless a request says otherwise
    # Workers it starts compute each request's tokens and logprobs bit for bit independently of
    # the other requests, chunking and prefix-cache hits (worker_svc/batch_invariant); slower.
    batch_invariant: bool = False
    # LoRA adapters of a locally started group (the workers' --max-loras, --max-lora-rank,
    # --max-cpu-loras): 0 slots serve none; remote workers report their own.
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # How a locally started group serves linear weights (the workers' --quantization; see
    # batchwire.common.worker_config.QUANTIZATIONS); remote workers report their own.
    quantization: str = "auto"
    cpu_decode: str = "native"  # the workers' --cpu-decode (worker_config.CPU_DECODES)
    # Adapters a server loads at start (--lora-modules NAME=PATH): (name, PEFT folder) pairs.
    lora_modules: tuple[tuple[str, str], ...] = ()
    worker_rpc_timeout_s: float = 600.0  # the longest one call may take (a long prefill on CPU)
    worker_heartbeat_s: float = 1.0  # liveness probe period; 3 missed probes = a failed worker
    # How long requests wait for a worker replica when none is live (the last one died, froze or
    # left) before failing with UNAVAILABLE: those it was running, which then resume where their
    # streams stand, and new ones. 0 = fail at once, as vLLM and SGLang do when their engine goes:
    # clients and routers retry UNAVAILABLE elsewhere, and a deployment with no replacement on
    # its way gains nothing by holding them. Worth setting where workers register or are
    # discovered and come back (a restart, a frozen process), e.g. 30.
    worker_grace_s: float = 0.0
    # TLS (mutual with a client certificate) on the gRPC links to workers; ZMQ has none.
    worker_tls: ClientTls | None = None
    # The token presented to workers on every call, both transports (the workers' own
    # --worker-token-file); None: none, unless this scheduler starts its workers itself, which
    # then get a fresh random one.
    worker_token_file: str | None = None
    # The Ray cluster of executor_backend "ray": "host:port" or "auto"; None: $RAY_ADDRESS, else a
    # local Ray started for this process.
    ray_address: str | None = None

    # Scheduling.
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    # A prefill longer than this is cut into chunks of this size so that it shares steps with
    # decodes instead of stalling them; 0 = no cap beyond the step's budget.
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority" (lower value runs first, then earlier arrival)
    max_model_len: int = 2048  # prompt + output; the worker's own limit may lower it
    max_queued_requests: int = 10_000  # waiting requests beyond this are refused at admission
    max_logprobs: int = 20  # the most top-n logprobs a request may ask for
    max_n: int = 16  # the most sequences one client request may sample (n)
    # Caps on a request's lists, so that one request cannot slow every step for the others
    # (20,000 stop strings on four requests once slowed a neighbouring stream by half).
    max_stop_strings: int = 64  # entries of `stop`, and of `bad_words`
    max_stop_chars: int = 4096  # characters of all `stop` strings, and of all `bad_words`
    max_token_ids: int = 2048  # entries of stop_token_ids, logit_bias and allowed_token_ids
    # The defaults of a request's unset sampling fields: "auto" = the model's generation config
    # (core/generation_config.py), "none" = SamplingParams' own, or a folder or
    # generation_config.json file to read them from.
    generation_config: str = "auto"
    # The syntax of the model's own tool calls, for tool_choice "auto" (core/tool_calls): one of
    # TOOL_CALL_PARSERS, "none" (auto is refused), or None = the one its chat template shows.
    tool_call_parser: str | None = None

    # Async scheduling: step N+1 is scheduled and sent while the worker computes step N,
    # each request sampling in N assumed to gain one token; a token computed for a request that
    # N stopped is dropped. With speculative decoding a step keeps 1 to d + 1 tokens, so a
    # request is scheduled only once its step is back, and two halves of the running requests
    # take turns (Scheduler._cohort). None = on where it was measured to pay (docs/performance.md):
    # a worker group in processes of its own, generating without speculative decoding; an
    # in-process worker runs on the engine's own thread, so there is nothing to overlap with.
    async_scheduling: bool | None = None

    # Speculative decoding (core/spec_decode.py): None = off; "ngram" = prompt-lookup drafts.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4  # the most drafts per request and step (K)
    # The suffix lengths the n-gram proposer matches, longest first. 2, not 1: a lone repeated
    # token predicts little, and a rejected draft still costs its position in the forward pass.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                    "max_queued_requests", "kv_cache_memory_bytes", "max_n")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, "
                             f"got {self.pooling_type!r}")
        if self.worker_rpc_timeout_s <= 0 or self.worker_heartbeat_s <= 0:
            raise ValueError("worker_rpc_timeout_s and worker_heartbeat_s must be positive, got "
                             f"{self.worker_rpc_timeout_s} and {self.worker_heartbeat_s}")
        if not 0 <= self.worker_grace_s < float("inf"):
            raise ValueError(f"worker_grace_s must be >= 0 and finite, got {self.worker_grace_s}")
        if self.worker_tls is not None and self.executor_backend in ("zmq", "auto"):
            raise ValueError("worker TLS needs the grpc transport: ZMQ links are not encrypted "
                             f"(executor_backend is {self.executor_backend!r})")
        for name in ("max_stop_strings", "max_stop_chars", "max_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.speculative_method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request needs at least one token per step.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit in one step, or it never runs.
            raise ValueError(f"without chunked prefill max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be at least max_model_len "
                             f"({self.max_model_len})")
        # The workers' own rules too (e.g. no LoRA with tensor parallelism), before any port is
        # bound or weights loaded: a worker group that cannot start is refused here, not later.
        self.worker_config()

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_logprobs, self.max_stop_strings, self.max_stop_chars,
                             self.max_token_ids)

    @property
    def world_size(self) -> int:
        """Ranks of a locally started worker group."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def worker_config(self) -> WorkerConfig:
        """The settings of an in-process worker that matches this scheduler."""
        return WorkerConfig(
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_reqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_logprobs=self.max_logprobs,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            task=self.task,
            pooling_type=self.pooling_type,
            normalize=self.normalize,
            batch_invariant=self.batch_invariant,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            quantization=self.quantization,
            cpu_decode=self.cpu_decode,
        )
