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
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from batchwire.common.env_options import env_default, env_name
from batchwire.common.ports import PortInUseError

from scheduler_svc.cli.client_commands import (
    CONNECT_TIMEOUT_S,
    add_client_options,
    add_lora_options,
    add_sampling_options,
    cmd_chat,
    cmd_generate,
)
from scheduler_svc.cli.server_options import (
    DEFAULTS,
    DRAIN_S,
    INTERACTIVE_DRAIN_S,
    add_engine_options,
    add_model_options,
    add_option,
    add_ray_option,
    add_server_options,
    add_task_options,
    add_worker_tls_options,
    add_worker_token_option,
)
from scheduler_svc.config import SchedulerConfig


def _drain_timeout(given: float | None) -> float:
    if given is not None:
        return given
    return INTERACTIVE_DRAIN_S if sys.stdin is not None and sys.stdin.isatty() else DRAIN_S


def _speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)


def _require_ray(args: argparse.Namespace) -> None:
    """--transport ray without Ray installed: one line naming the extra, before anything loads."""
    if args.transport != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit(f"batchwire {args.command}: --transport ray needs Ray: "
                         "pip install 'batchwire[ray]'") from None


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
        quantization=args.quantization, cpu_decode=args.cpu_decode,
        lora_modules=tuple(args.lora_modules),
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
    add_model_options(serve)
    w = serve.add_argument_group("workers")
    add_option(w, "--transport", "auto", "how the scheduler reaches its workers (auto: uni for "
               "one worker, zmq for a tensor-parallel group; ray: groups that Ray places, driven "
               "over zmq)", choices=("auto", "uni", "grpc", "zmq", "ray"))
    add_option(w, "--tensor-parallel-size", 1, "worker processes sharding the model", type=int)
    add_option(w, "--replicas", 1, "independent worker groups (data parallel), each with its own "
               "KV cache; a request goes to the least loaded", type=int)
    add_ray_option(w)
    add_worker_token_option(w)
    add_engine_options(serve)
    add_task_options(serve)
    add_server_options(serve)
    serve.set_defaults(func=cmd_serve)

    scheduler = sub.add_parser(
        "scheduler", help="the scheduler alone, driving workers started elsewhere",
        description="Serve the client API and drive workers started on their own "
        "(`batchwire worker`): the groups listed with --worker-addresses, the pods found with "
        "--discover-workers, and any group that registers (`batchwire worker "
        "--scheduler-address HOST:PORT`, this server's port). With no group listed it serves "
        "once the first one registers. The model options must match the workers'.")
    add_model_options(scheduler)
    w = scheduler.add_argument_group("workers")
    add_option(w, "--transport", "zmq", "how to reach the workers (ray: also start them, as "
               "--replicas groups that Ray places)", choices=("grpc", "zmq", "ray"))
    add_option(w, "--replicas", 1, "with --transport ray: worker groups to place", type=int)
    add_ray_option(w)
    env = env_name("--worker-addresses")
    w.add_argument("--worker-addresses", nargs="+", metavar="GROUP",
                   default=env_default("--worker-addresses", "").replace(";", " ").split(),
                   help="one worker group per argument: its ranks' host:port on the transport's "
                   f"port, comma-separated in rank order [{env}, groups separated by spaces]")
    add_option(w, "--discover-workers", None, "Kubernetes: drive the worker pods this label "
               "selector picks in the namespace (get/list/watch on pods), e.g. "
               "app.kubernetes.io/component=worker")
    add_option(w, "--discovery-namespace", None, "namespace of the worker pods (default: the "
               "scheduler pod's own)")
    add_option(w, "--worker-heartbeat-s", DEFAULTS["worker_heartbeat_s"], "seconds between "
               "liveness probes of each worker; three missed ones fail it (a frozen worker is "
               "noticed after about three periods)", type=float)
    add_option(w, "--worker-drain-timeout", 120.0, "seconds a leaving worker's running requests "
               "may finish there before they move to other workers", type=float)
    add_worker_tls_options(w)
    add_worker_token_option(w)
    add_engine_options(scheduler)
    add_task_options(scheduler)
    add_server_options(scheduler)
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
    chat.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT_S,
                      help="seconds to wait for the server before the first prompt "
                      "(default: %(default)g)")
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
