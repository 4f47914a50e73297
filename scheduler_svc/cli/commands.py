"""`batchwire`: one command for serving, calling and measuring.

  serve      the scheduler and its workers in one command (in-process worker by default)
  scheduler  the scheduler alone, driving workers started elsewhere
  worker     one worker (or a tensor-parallel group)
  generate   stream one completion from a running server to the terminal
  chat       an interactive conversation with a running server
  bench      benchmarks (`python -m batchwire.benchmarks`)

Every option of serve, scheduler and worker can also be set as an environment variable
BATCHWIRE_<OPTION> (e.g. BATCHWIRE_PORT=50051, BATCHWIRE_NO_PREFIX_CACHING=1), for containers;
a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from batchwire.common.env_options import env_bool, env_default, env_flag, env_name
from batchwire.common.ports import PortInUseError
from batchwire.common.sizes import byte_size, format_size
from batchwire.common.worker_config import POOLING_TYPES, QUANTIZATIONS, TASKS

from scheduler_svc.cli.client_commands import (
    add_client_options,
    add_lora_options,
    add_sampling_options,
    cmd_chat,
    cmd_generate,
    lora_module,
)
from scheduler_svc.config import POLICIES, TOOL_CALL_PARSERS, SchedulerConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
DRAIN_S = 600.0  # an orchestrator's drain: long requests finish before a rollout moves on
INTERACTIVE_DRAIN_S = 30.0  # a person at the terminal who pressed Ctrl-C


def _drain_timeout(given: float | None) -> float:
    if given is not None:
        return given
    return INTERACTIVE_DRAIN_S if sys.stdin is not None and sys.stdin.isatty() else DRAIN_S


def _option(group: Any, flag: str, default: Any, help: str, type: Callable = str,
            **kwargs: Any) -> None:
    """An option whose default comes from BATCHWIRE_<OPTION> when that is set."""
    shown = format_size(default) if type is byte_size and default else "%(default)s"
    # With no default the help text says what happens without the option.
    where = env_name(flag) if default is None else f"{env_name(flag)}; default: {shown}"
    group.add_argument(flag, type=type, default=env_default(flag, default),
                       help=f"{help} [{where}]", **kwargs)


def _flag(group: Any, flag: str, help: str) -> None:
    group.add_argument(flag, action="store_true",
                       default=env_flag(flag), help=f"{help} [{env_name(flag)}=1]")


# Options of the scheduler service, shared by serve and scheduler.

def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    _option(g, "--model", None, "checkpoint directory (config.json + safetensors) or .gguf "
            "file; default: the embedded SmolLM2-135M-Instruct")
    _option(g, "--dtype", _DEFAULTS["dtype"], "weights, activations and KV cache",
            choices=("bfloat16", "float16", "float32"))
    _option(g, "--quantization", _DEFAULTS["quantization"], "linear weights: auto = a GGUF "
            "file's Q4_0/Q4_1/Q8_0 tensors served as stored (int4/int8 CPU kernels) with "
            "bfloat16, else none; none = de-quantised to --dtype; int8/int4 = every linear "
            "weight so (workers this command starts; GetModelInfo.weights says what is served)",
            choices=QUANTIZATIONS)
    _option(g, "--generation-config", _DEFAULTS["generation_config"], "defaults of a request's "
            "unset sampling fields: auto = the model's generation config (GetModelInfo shows "
            "them), none = batchwire's (temperature 1...), or a folder or generation_config.json "
            "to read them from", metavar="auto|none|PATH")
    _option(g, "--tool-call-parser", None, "the syntax of the model's own tool calls, read "
            "for tool_choice auto (the default with tools): none refuses auto; unset: the one "
            "the chat template shows (the embedded model: smollm2)", choices=TOOL_CALL_PARSERS)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache and scheduling")
    _option(g, "--kv-cache-memory", _DEFAULTS["kv_cache_memory_bytes"],
            "bytes of KV cache per worker, e.g. 512M or 4G", type=byte_size)
    _option(g, "--block-size", _DEFAULTS["block_size"], "tokens per KV-cache block", type=int)
    _option(g, "--max-model-len", _DEFAULTS["max_model_len"],
            "longest sequence, prompt plus output, in tokens", type=int)
    _option(g, "--max-num-seqs", _DEFAULTS["max_num_seqs"], "most requests running at once",
            type=int)
    _option(g, "--max-num-batched-tokens", _DEFAULTS["max_num_batched_tokens"],
            "token budget of one step", type=int)
    _option(g, "--max-queued-requests", _DEFAULTS["max_queued_requests"],
            "waiting requests beyond this are refused with RESOURCE_EXHAUSTED", type=int)
    _option(g, "--max-logprobs", _DEFAULTS["max_logprobs"],
            "most top-n logprobs a request may ask for", type=int)
    _option(g, "--max-n", _DEFAULTS["max_n"], "most sequences one request may sample (n)",
            type=int)
    _option(g, "--max-stop-strings", _DEFAULTS["max_stop_strings"], "most stop strings (and "
            "bad words) one request may send", type=int)
    _option(g, "--max-stop-chars", _DEFAULTS["max_stop_chars"], "most characters in all of a "
            "request's stop strings (and in all its bad words)", type=int)
    _option(g, "--max-token-ids", _DEFAULTS["max_token_ids"], "most entries in a request's "
            "stop_token_ids, logit_bias and allowed_token_ids, each", type=int)
    _option(g, "--long-prefill-token-threshold", _DEFAULTS["long_prefill_token_threshold"],
            "cut prefills into chunks of at most this many tokens (0 = the step's budget)",
            type=int)
    _option(g, "--policy", _DEFAULTS["policy"], "admission order: first come first served, or "
            "by request priority", choices=POLICIES)
    _option(g, "--seed", _DEFAULTS["seed"], "seeds requests that bring no seed", type=int)
    _option(g, "--worker-grace-s", _DEFAULTS["worker_grace_s"], "seconds requests wait for a "
            "worker to join or return when none is live (the last one died, froze or left) "
            "before failing with UNAVAILABLE; the ones it was running then resume where they "
            "stood (0 = fail at once)", type=float)
    _flag(g, "--no-prefix-caching", "do not reuse the KV cache of shared prompt prefixes")
    _flag(g, "--no-chunked-prefill", "run every prompt in one step")
    env = env_name("--async-scheduling")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=env_bool("--async-scheduling"),
                   help="schedule each step while the worker computes the one before (default: "
                   "on for workers in processes of their own without speculative decoding, "
                   f"where it pays; off in process) [{env}=1 or 0]")
    _add_speculative_options(p)


def _add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (off unless --speculative-method is given)")
    _option(g, "--speculative-method", None, "propose draft tokens for running requests and "
            "verify them in one forward pass; ngram: prompt lookup, no draft model",
            choices=("ngram",))
    _option(g, "--num-speculative-tokens", _DEFAULTS["num_speculative_tokens"],
            "most draft tokens per request and step", type=int)
    _option(g, "--prompt-lookup-min", _DEFAULTS["prompt_lookup_min"],
            "shortest suffix the n-gram proposer matches", type=int)
    _option(g, "--prompt-lookup-max", _DEFAULTS["prompt_lookup_max"],
            "longest suffix the n-gram proposer matches (tried first)", type=int)


def _speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)


def _add_task_options(p: argparse.ArgumentParser) -> None:
    """What the workers serve, and how their layers are split; passed on to the workers this
    command starts (SchedulerConfig.worker_config), which report it back (GetInfo)."""
    g = p.add_argument_group("task and pipeline")
    _option(g, "--task", _DEFAULTS["task"], "generate tokens, or embed inputs (Generation.Embed)",
            choices=TASKS)
    _option(g, "--pooling-type", _DEFAULTS["pooling_type"], "how an embedding is pooled from "
            "the final hidden states", choices=POOLING_TYPES)
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                   default=env_flag("--normalize", default=True),
                   help="L2-normalise embeddings [BATCHWIRE_NORMALIZE; default: on]")
    _option(g, "--pipeline-parallel-size", _DEFAULTS["pipeline_parallel_size"],
            "pipeline stages per worker group, each of --tensor-parallel-size processes",
            type=int)
    g.add_argument("--batch-invariant", action="store_true",
                   default=env_flag("--batch-invariant"),
                   help="each request's tokens and logprobs the same, bit for bit, whatever else "
                   "runs beside it (fixed-shape matmuls and attention in the workers it starts; "
                   "slower) [BATCHWIRE_BATCH_INVARIANT]")
    g = p.add_argument_group("LoRA adapters (PEFT folders of the base model)")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                   type=lora_module, help="adapters served from the start, by name (more load "
                   "at run time: POST /v1/load_lora_adapter, Generation.LoadLoRAAdapter)")
    _option(g, "--max-loras", _DEFAULTS["max_loras"], "adapter slots in each worker: most "
            "adapters one step mixes (0: serve none)", type=int)
    _option(g, "--max-lora-rank", _DEFAULTS["max_lora_rank"], "highest adapter rank served",
            type=int)
    _option(g, "--max-cpu-loras", _DEFAULTS["max_cpu_loras"], "adapters each worker keeps "
            "in host memory, least recently used dropped first (0: as many as --max-loras)",
            type=int)


def _add_server_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("client API")
    _option(g, "--host", "127.0.0.1", "address the client, HTTP and metrics ports bind: "
            "loopback, this machine alone, unless told otherwise (0.0.0.0 = every interface; "
            "the container images and manifests set it)")
    _option(g, "--port", 50051, "gRPC port for clients (0 = any free port)", type=int)
    _option(g, "--metrics-port", 9090, "Prometheus /metrics port (0 = any free port)", type=int)
    _flag(g, "--no-metrics", "serve no /metrics")
    _option(g, "--http-port", 8000, "OpenAI-compatible HTTP API port (/v1/completions, "
            "/v1/chat/completions, ...; 0 = any free port)", type=int)
    _flag(g, "--no-http", "serve no HTTP API")
    _flag(g, "--side-ports-fallback", "when the metrics or HTTP port is in use, serve it on a "
          "free port instead of stopping, and say which (make run sets it)")
    # Sized from the model by default: a body larger than the longest prompt that can fit
    # max_model_len only costs memory and event-loop time to read (openai/body.py).
    _option(g, "--max-request-bytes", None, "largest HTTP request body, e.g. 8M; larger ones "
            "get 413 while still arriving (default: 4 bytes per character of the longest text "
            "prompt that can fit max_model_len, at least 1M)", type=byte_size)
    env = env_name("--served-model-name")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   default=env_default("--served-model-name", "").split(),
                   help="the names /v1/models lists and requests' `model` may use, the first "
                   f"reported back [{env}, space-separated; default: the model's name]")
    _option(g, "--ready-file", None, "write the bound ports here as JSON once bound")
    _option(g, "--drain-timeout", None, "seconds requests in flight may take to finish after "
            f"SIGTERM or Ctrl-C (a second one stops at once); default: {INTERACTIVE_DRAIN_S:.0f} "
            f"when run from a terminal, where a person waits, else {DRAIN_S:.0f}", type=float)
    _option(g, "--max-message-size", 16 << 20, "largest request or response message, in bytes",
            type=byte_size)
    _option(g, "--max-connection-age", 600.0, "seconds after which a client connection is "
            "closed (its streams get as long again to finish), so clients rebalance",
            type=float)
    _option(g, "--log-level", "INFO", "logging level")
    _flag(g, "--no-progress", "no progress bar while the model loads")
    g = p.add_argument_group("security (PEM files, e.g. a mounted Kubernetes Secret)")
    _option(g, "--tls-cert", None, "serve clients over TLS with this certificate (and --tls-key)")
    _option(g, "--tls-key", None, "the private key of --tls-cert")
    _option(g, "--tls-client-ca", None, "require client certificates signed by this CA")
    _option(g, "--api-key-file", None, "require `authorization: Bearer <key>` on the Generation "
            "service, with a key listed in this file (one a line; read again when it changes)")
    _option(g, "--health-port", None, "also answer health checks, and nothing else, in plaintext "
            "on this port: Kubernetes' gRPC probes cannot speak TLS", type=int)


def _add_worker_tls_options(g: Any) -> None:
    _option(g, "--worker-tls-ca", None, "dial workers over TLS, trusting this CA (needs "
            "--transport grpc)")
    _option(g, "--worker-tls-cert", None, "client certificate presented to workers (mutual TLS)")
    _option(g, "--worker-tls-key", None, "the private key of --worker-tls-cert")
    _option(g, "--worker-tls-server-name", None, "the name workers' certificates carry, checked "
            "instead of the address dialled (pods are dialled by IP)")


def _add_ray_option(g: Any) -> None:
    _option(g, "--ray-address", None, "with --transport ray: the Ray cluster, host:port "
            "(default: $RAY_ADDRESS, else a local Ray started for this process)")


def _require_ray(args: argparse.Namespace) -> None:
    """--transport ray without Ray installed: one line naming the extra, before anything loads."""
    if args.transport != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit(f"batchwire {args.command}: --transport ray needs Ray: "
                         "pip install 'batchwire[ray]'") from None


def _add_worker_token_option(g: Any) -> None:
    _option(g, "--worker-token-file", None, "present the first token of this file (one a line; "
            "read again when it changes) on every call to the workers, both transports; they "
            "must list it in their own --worker-token-file (workers started here get a random "
            "one otherwise)")


def _worker_tls(args: argparse.Namespace) -> Any:
    from batchwire.common.tls import ClientTls

    try:
        return ClientTls.from_options(args.worker_tls_ca, args.worker_tls_cert,
                                      args.worker_tls_key, args.worker_tls_server_name,
                                      what="--worker-tls")
    except ValueError as e:
        raise SystemExit(f"batchwire: {e}") from None


def _scheduler_config(args: argparse.Namespace, **extra: Any) -> SchedulerConfig:
    try:
        return _new_scheduler_config(args, **extra)
    except ValueError as e:  # a value out of range: its field and value, not a traceback
        raise SystemExit(f"batchwire {args.command}: {e}") from None


def _new_scheduler_config(args: argparse.Namespace, **extra: Any) -> SchedulerConfig:
    return SchedulerConfig(
        model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory,
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests, max_logprobs=args.max_logprobs,
        max_n=args.max_n, max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars, max_token_ids=args.max_token_ids,
        long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.policy,
        worker_token_file=args.worker_token_file,
        seed=args.seed, enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill, task=args.task,
        pooling_type=args.pooling_type, normalize=args.normalize,
        batch_invariant=args.batch_invariant, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        quantization=args.quantization, lora_modules=tuple(args.lora_modules),
        pipeline_parallel_size=args.pipeline_parallel_size,
        generation_config=args.generation_config, tool_call_parser=args.tool_call_parser,
        async_scheduling=args.async_scheduling, worker_grace_s=args.worker_grace_s,
        **_speculative_config(args), **extra)


def _run_server(args: argparse.Namespace, scheduler: SchedulerConfig, replicas: int = 1,
                **server: Any) -> int:
    from batchwire.common.key_file import WorkerToken

    from scheduler_svc.core.generation_config import load_generation_config
    from scheduler_svc.service.security import ApiKeys, ServerTls
    from scheduler_svc.service.server import (  # grpc and torch: only when serving
        ServerConfig,
        serve,
    )

    try:
        tls = ServerTls.from_options(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.api_key_file:
            ApiKeys.from_file(args.api_key_file)  # a missing or empty file fails here, not later
        if args.worker_token_file:
            WorkerToken.from_file(args.worker_token_file)
        # Likewise a generation config that cannot be read or holds bad values.
        load_generation_config(scheduler.model, scheduler.generation_config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"batchwire: {e}") from None
    config = ServerConfig(
        tls=tls, api_key_file=args.api_key_file, health_port=args.health_port,
        metrics_host=args.host,
        scheduler=scheduler, host=args.host, port=args.port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        http_port=None if args.no_http else args.http_port,
        served_model_names=tuple(args.served_model_name),
        max_request_bytes=args.max_request_bytes, side_ports_fallback=args.side_ports_fallback,
        ready_file=args.ready_file, drain_timeout_s=_drain_timeout(args.drain_timeout),
        max_message_bytes=args.max_message_size, max_connection_age_s=args.max_connection_age,
        max_connection_age_grace_s=args.max_connection_age, progress=not args.no_progress,
        replicas=replicas, **server)
    try:
        return serve(config)
    except PortInUseError as e:
        print(f"batchwire {args.command}: {e.strerror}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    _require_ray(args)
    transport = args.transport
    if args.replicas > 1:
        if transport == "uni":
            raise SystemExit("batchwire serve: --replicas runs worker groups side by side in "
                             "processes of their own: use --transport zmq or grpc")
        transport = "zmq" if transport == "auto" else transport
    return _run_server(args, _scheduler_config(
        args, executor_backend=transport, tensor_parallel_size=args.tensor_parallel_size,
        ray_address=args.ray_address), replicas=args.replicas)


def cmd_scheduler(args: argparse.Namespace) -> int:
    groups = tuple(g for g in args.worker_addresses if g)
    if groups and args.discover_workers:
        raise SystemExit("batchwire scheduler: --worker-addresses or --discover-workers, not both")
    _require_ray(args)
    if args.transport == "ray":  # Ray places and starts the groups: none is listed
        if groups or args.discover_workers:
            raise SystemExit("batchwire scheduler: --transport ray starts its own worker groups: "
                             "no --worker-addresses or --discover-workers")
        return _run_server(args, _scheduler_config(
            args, executor_backend="ray", ray_address=args.ray_address,
            worker_heartbeat_s=args.worker_heartbeat_s), replicas=args.replicas)
    return _run_server(args, _scheduler_config(args, executor_backend=args.transport,
                                               worker_addresses=groups,
                                               worker_heartbeat_s=args.worker_heartbeat_s,
                                               worker_tls=_worker_tls(args)),
                       # With neither, it serves once a group registers (--scheduler-address).
                       replicas=0 if not groups else 1,
                       discover_workers=args.discover_workers or None,
                       discovery_namespace=args.discovery_namespace,
                       worker_drain_timeout_s=args.worker_drain_timeout)


def _delegate(module: str, what: str, argv: list[str]) -> int:
    try:
        entry = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            print(f"batchwire: {what} is not in this build ({module} is missing)",
                  file=sys.stderr)
            return 2
        raise
    return int(entry.main(argv) or 0)


# The parser.

def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchwire", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"batchwire {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", help="serve a model: the scheduler and its workers in one command",
        description="Serve a model over gRPC (service batchwire.v1.Generation): the scheduler "
        "plus its workers. With --transport uni the worker runs in this process; with grpc or "
        "zmq the workers run as child processes and the scheduler talks to them over loopback.")
    _add_model_options(serve)
    w = serve.add_argument_group("workers")
    _option(w, "--transport", "auto", "how the scheduler reaches its workers (auto: uni for "
            "one worker, zmq for a tensor-parallel group; ray: groups that Ray places, driven "
            "over zmq)", choices=("auto", "uni", "grpc", "zmq", "ray"))
    _option(w, "--tensor-parallel-size", 1, "worker processes sharding the model", type=int)
    _option(w, "--replicas", 1, "independent worker groups (data parallel), each with its own "
            "KV cache; a request goes to the least loaded", type=int)
    _add_ray_option(w)
    _add_worker_token_option(w)
    _add_engine_options(serve)
    _add_task_options(serve)
    _add_server_options(serve)
    serve.set_defaults(func=cmd_serve)

    scheduler = sub.add_parser(
        "scheduler", help="the scheduler alone, driving workers started elsewhere",
        description="Serve the client API and drive workers started on their own "
        "(`batchwire worker`): the groups listed with --worker-addresses, the pods found with "
        "--discover-workers, and any group that registers (`batchwire worker "
        "--scheduler-address HOST:PORT`, this server's port). With no group listed it serves "
        "once the first one registers. The model options must match the workers'.")
    _add_model_options(scheduler)
    w = scheduler.add_argument_group("workers")
    _option(w, "--transport", "zmq", "how to reach the workers (ray: also start them, as "
            "--replicas groups that Ray places)", choices=("grpc", "zmq", "ray"))
    _option(w, "--replicas", 1, "with --transport ray: worker groups to place", type=int)
    _add_ray_option(w)
    env = env_name("--worker-addresses")
    w.add_argument("--worker-addresses", nargs="+", metavar="GROUP",
                   default=env_default("--worker-addresses", "").replace(";", " ").split(),
                   help="one worker group per argument: its ranks' host:port on the transport's "
                   f"port, comma-separated in rank order [{env}, groups separated by spaces]")
    _option(w, "--discover-workers", None, "Kubernetes: drive the worker pods this label "
            "selector picks in the namespace (get/list/watch on pods), e.g. "
            "app.kubernetes.io/component=worker")
    _option(w, "--discovery-namespace", None, "namespace of the worker pods (default: the "
            "scheduler pod's own)")
    _option(w, "--worker-heartbeat-s", _DEFAULTS["worker_heartbeat_s"], "seconds between "
            "liveness probes of each worker; three missed ones fail it (a frozen worker is "
            "noticed after about three periods)", type=float)
    _option(w, "--worker-drain-timeout", 120.0, "seconds a leaving worker's running requests "
            "may finish there before they move to other workers", type=float)
    _add_worker_tls_options(w)
    _add_worker_token_option(w)
    _add_engine_options(scheduler)
    _add_task_options(scheduler)
    _add_server_options(scheduler)
    scheduler.set_defaults(func=cmd_scheduler)

    sub.add_parser("worker", add_help=False,
                   help="one worker or a tensor-parallel group (see `batchwire worker --help`)")
    sub.add_parser("bench", add_help=False, help="benchmarks (see `batchwire bench --help`)")

    generate = sub.add_parser("generate", help="stream one completion from a running server",
                              description="Stream one completion to the terminal.")
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt text; - reads stdin")
    mode = generate.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="send the prompt as plain text to be "
                      "continued, without the model's chat template")
    mode.add_argument("--chat", action="store_true", help="send the prompt as a user message "
                      "through the chat template (the default when the model has one)")
    generate.add_argument("--system", help="a system message before the prompt (not with --raw)")
    generate.add_argument("--quiet", action="store_true", help="no usage line on stderr")
    add_lora_options(generate)
    add_client_options(generate)
    add_sampling_options(generate)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive conversation with a running server",
                          description="Chat with the model; the conversation is kept and "
                          "sent whole, through the model's chat template, every turn.")
    chat.add_argument("--system", help="a system message opening the conversation")
    add_client_options(chat)
    add_sampling_options(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


_DELEGATES = {
    "worker": ("worker_svc.__main__", "the worker service"),
    "bench": ("batchwire.benchmarks.__main__", "the bench command"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:
        module, what = _DELEGATES[argv[0]]
        return _delegate(module, what, argv[1:])
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("generate", "chat"):
        from scheduler_svc.cli.client_errors import run_client

        return run_client(args.command, args.func, args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
