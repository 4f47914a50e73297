"""The worker's command-line options (`python -m worker_svc`, `batchwire worker`) and the
WorkerConfig they make. Every option can also be set as BATCHWIRE_<OPTION>
(batchwire.common.env_options, the scheduler CLI's reader too)."""

from __future__ import annotations

import argparse
import dataclasses

from batchwire.common.env_options import env_default, env_flag
from batchwire.common.sizes import byte_size
from batchwire.common.worker_config import (
    CPU_DECODES,
    DTYPES,
    POOLING_TYPES,
    QUANTIZATIONS,
    TASKS,
    WorkerConfig,
)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The worker's options; pass a parser (a CLI sub-command's) to fill it instead of a new one."""
    p = parser or argparse.ArgumentParser(
        prog="batchwire worker",
        description="Serve a model's forward pass and sampling to a batchwire scheduler over gRPC "
        "and ZMQ. Every option can also be set as BATCHWIRE_<OPTION> (e.g. "
        "BATCHWIRE_PORT=50061).",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=env_default("model", None),
        help="checkpoint directory (config.json + safetensors) or .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    model.add_argument(
        "--dtype", default=env_default("dtype", _DEFAULTS["dtype"]), choices=sorted(DTYPES)
    )
    model.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=env_default("quantization", _DEFAULTS["quantization"]),
        help="linear weights: auto = a GGUF file's Q4_0/Q4_1/Q8_0 tensors served as stored "
        "(int4/int8 kernels) with bfloat16 on CPU, else none; none = de-quantised to --dtype; "
        "int8/int4 = every linear weight so, float ones quantized at load (default: %(default)s)",
    )
    model.add_argument(
        "--cpu-decode",
        choices=CPU_DECODES,
        default=env_default("cpu_decode", _DEFAULTS["cpu_decode"]),
        help="CPU steps: native = up to 8 decode rows in one compiled C call, other steps "
        "torch's products with the rest in C, where the weights are served quantized (torch "
        "where it cannot); torch = every step on the torch path (default: %(default)s)",
    )
    model.add_argument(
        "--device",
        default=env_default("device", _DEFAULTS["device"]),
        help="cpu, cuda or cuda:N (default: %(default)s)",
    )
    model.add_argument(
        "--attention-backend",
        choices=("auto", "torch", "triton"),
        default=env_default("attention_backend", _DEFAULTS["attention_backend"]),
    )
    model.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=env_flag("batch_invariant"),
        help="each request's tokens and logprobs the same, bit for bit, whatever else runs "
        "beside it (fixed-shape matmuls and attention; slower)",
    )
    cache = p.add_argument_group("KV cache and batch")
    cache.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=env_default("kv_cache_memory", _DEFAULTS["kv_cache_memory_bytes"]),
        help="bytes for all layers' K and V (e.g. 512M, 2G; default 1G)",
    )
    for name, help_text in (
        ("block_size", "tokens per KV-cache block"),
        ("max_num_reqs", "rows of the persistent batch: most requests in one step"),
        ("max_model_len", "longest sequence, prompt plus output"),
        ("max_num_batched_tokens", "most tokens one step may schedule"),
        ("max_logprobs", "most top-n logprobs a request may ask for"),
        ("seed", "seeds the sampling of requests that bring no seed"),
        ("max_loras", "LoRA adapter slots: most adapters one step may use (0: serve none)"),
        ("max_lora_rank", "highest LoRA adapter rank the slots hold"),
        ("max_cpu_loras", "adapters kept on the host, least recently used dropped first "
         "(0: as many as --max-loras)"),
    ):
        cache.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=env_default(name, _DEFAULTS[name]),
            help=f"{help_text} (default: %(default)s)",
        )
    model.add_argument(
        "--task",
        choices=TASKS,
        default=env_default("task", _DEFAULTS["task"]),
        help="generate: sample tokens; embed: answer each input with its pooled final hidden "
        "states (default: %(default)s)",
    )
    model.add_argument(
        "--pooling-type",
        choices=POOLING_TYPES,
        default=env_default("pooling_type", _DEFAULTS["pooling_type"]),
        help="with --task embed: the last token's state (the one that saw the whole input), the "
        "mean over the input, or the first token's (default: %(default)s)",
    )
    model.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=env_flag("normalize", default=True),
        help="L2-normalise pooled vectors unless a request says otherwise (default: on)",
    )
    tp = p.add_argument_group("tensor and pipeline parallel")
    tp.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=env_default("tensor_parallel_size", 1),
        help="ranks that shard each stage's layers; without --rank all are started here",
    )
    tp.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=env_default("pipeline_parallel_size", 1),
        help="stages the layers are split into, each of --tensor-parallel-size ranks; "
        "without --rank all are started here",
    )
    tp.add_argument(
        "--rank",
        type=int,
        default=env_default("rank", None),
        help="serve only this global rank of the group, pp_rank * tensor-parallel-size + "
        "tp_rank (ranks started one by one)",
    )
    tp.add_argument(
        "--distributed-init-method",
        default=env_default("distributed_init_method", None),
        help="torch.distributed rendezvous, e.g. tcp://host:29500 (default: a free "
        "local port when this process starts the group)",
    )
    net = p.add_argument_group("network")
    net.add_argument(
        "--host",
        default=env_default("host", "127.0.0.1"),
        help="address to bind: loopback by default, the pod IP in Kubernetes "
        "(0.0.0.0 = every interface)",
    )
    net.add_argument(
        "--port",
        type=int,
        default=env_default("port", 50061),
        help="gRPC port (0 = any free port; rank r of a group: port + 2r)",
    )
    net.add_argument(
        "--zmq-port",
        type=int,
        default=env_default("zmq_port", 50062),
        help="ZMQ port (0 = any free port; rank r of a group: port + 2r)",
    )
    net.add_argument(
        "--scheduler-address",
        default=env_default("scheduler_address", None),
        help="host:port of a scheduler to register with once serving",
    )
    net.add_argument(
        "--scheduler-lost-s",
        type=float,
        default=env_default("scheduler_lost_s", 60.0),
        help="free the batch (as Reset) when it holds requests and no call came from the "
        "scheduler for this long: the scheduler lost this worker; longer than the scheduler "
        "takes to notice a lost worker, 3 x its --worker-heartbeat-s (0 = never)",
    )
    net.add_argument(
        "--advertise-host",
        default=env_default("advertise_host", None),
        help="host the scheduler should dial (default: --host, or this machine's "
        "address when --host is 0.0.0.0)",
    )
    net.add_argument(
        "--ready-file",
        default=env_default("ready_file", None),
        help="write the bound ports here as JSON once serving",
    )
    net.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit (as on SIGTERM) once this process is gone: set by a scheduler or a group "
        "launcher that started this worker, so that none outlives it",
    )
    net.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("metrics_port", 9091),
        help="Prometheus /metrics port (0 = any free port; rank r of a group: port + r; "
        "a taken port stops the worker, as any other port does)",
    )
    net.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    net.add_argument("--log-level", default=env_default("log_level", "INFO"))
    sec = p.add_argument_group("security (PEM files, e.g. a mounted Kubernetes Secret)")
    sec.add_argument(
        "--tls-cert",
        default=env_default("tls_cert", None),
        help="serve gRPC over TLS with this certificate (and --tls-key)",
    )
    sec.add_argument("--tls-key", default=env_default("tls_key", None))
    sec.add_argument(
        "--tls-ca",
        default=env_default("tls_ca", None),
        help="require client certificates signed by this CA (mutual TLS)",
    )
    reg = p.add_argument_group("registration's link to the scheduler (its client port)")
    for name, help_text in (
        ("scheduler_tls_ca", "register over TLS, trusting this CA for the scheduler's certificate"),
        ("scheduler_tls_cert", "certificate to present (the scheduler's --tls-client-ca)"),
        ("scheduler_tls_key", "the private key of --scheduler-tls-cert"),
        ("scheduler_tls_server_name", "the name the scheduler's certificate carries, checked "
         "instead of the address dialled"),
        ("scheduler_api_key_file", "send the file's first key as `authorization: Bearer <key>` "
         "(the scheduler's --api-key-file; read again at each attempt)"),
    ):
        reg.add_argument(
            f"--{name.replace('_', '-')}", default=env_default(name, None), help=help_text
        )
    sec.add_argument(
        "--worker-token-file",
        default=env_default("worker_token_file", None),
        help="answer Worker calls (steps, Reset, Shutdown, GetInfo) only when they present a "
        "token listed in this file, one a line (the scheduler's --worker-token-file; read again "
        "when it changes); health checks stay open",
    )
    sec.add_argument(
        "--health-port",
        type=int,
        default=env_default("health_port", None),
        help="also answer health checks, and nothing else, in plaintext on this "
        "port (rank 0 only): Kubernetes' gRPC probes cannot speak TLS",
    )
    sec.add_argument(
        "--no-zmq",
        action="store_true",
        default=env_flag("no_zmq"),
        help="open no ZMQ port (it has no TLS); the scheduler uses gRPC",
    )
    return p


def worker_config(
    args: argparse.Namespace, rank: int = 0, init_method: str | None = None
) -> WorkerConfig:
    return WorkerConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_reqs=args.max_num_reqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_logprobs=args.max_logprobs,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        rank=rank,
        distributed_init_method=init_method or _DEFAULTS["distributed_init_method"],
        task=args.task,
        pooling_type=args.pooling_type,
        normalize=args.normalize,
        batch_invariant=args.batch_invariant,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        quantization=args.quantization,
        cpu_decode=args.cpu_decode,
    )
