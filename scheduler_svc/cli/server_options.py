"""The options of `batchwire serve`, `scheduler` and (through them) the worker groups they start:
each one's default comes from BATCHWIRE_<OPTION> when that is set, so a container sets options
through its environment; a flag on the command line wins."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from batchwire.common.env_options import env_bool, env_default, env_flag, env_name
from batchwire.common.sizes import byte_size, format_size
from batchwire.common.worker_config import CPU_DECODES, POOLING_TYPES, QUANTIZATIONS, TASKS

from scheduler_svc.cli.client_commands import lora_module
from scheduler_svc.config import POLICIES, TOOL_CALL_PARSERS, SchedulerConfig

DRAIN_S = 600.0  # an orchestrator's drain: long requests finish before a rollout moves on
INTERACTIVE_DRAIN_S = 30.0  # a person at the terminal who pressed Ctrl-C
DEFAULTS = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}


def add_option(group: Any, flag: str, default: Any, help: str, type: Callable = str,
               **kwargs: Any) -> None:
    """An option whose default comes from BATCHWIRE_<OPTION> when that is set."""
    shown = format_size(default) if type is byte_size and default else "%(default)s"
    # With no default the help text says what happens without the option.
    where = env_name(flag) if default is None else f"{env_name(flag)}; default: {shown}"
    group.add_argument(flag, type=type, default=env_default(flag, default),
                       help=f"{help} [{where}]", **kwargs)


def add_flag(group: Any, flag: str, help: str) -> None:
    group.add_argument(flag, action="store_true",
                       default=env_flag(flag), help=f"{help} [{env_name(flag)}=1]")


# Options of the scheduler service, shared by serve and scheduler.

def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    add_option(g, "--model", None, "checkpoint directory (config.json + safetensors) or .gguf "
               "file; default: the embedded SmolLM2-135M-Instruct")
    add_option(g, "--dtype", DEFAULTS["dtype"], "weights, activations and KV cache",
               choices=("bfloat16", "float16", "float32"))
    add_option(g, "--quantization", DEFAULTS["quantization"], "linear weights: auto = a GGUF "
               "file's Q4_0/Q4_1/Q8_0 tensors served as stored (int4/int8 CPU kernels) with "
               "bfloat16, else none; none = de-quantised to --dtype; int8/int4 = every linear "
               "weight so (workers this command starts; GetModelInfo.weights says what is served)",
               choices=QUANTIZATIONS)
    add_option(g, "--cpu-decode", DEFAULTS["cpu_decode"], "CPU steps: native = up to 8 "
               "decode rows in one compiled C call, other steps torch's products with the rest "
               "in C, where the weights are served quantized (built with the machine's C "
               "compiler at first use; torch where it cannot); torch = every step on the torch "
               "path", choices=CPU_DECODES)
    add_option(g, "--generation-config", DEFAULTS["generation_config"], "defaults of a request's "
               "unset sampling fields: auto = the model's generation config (GetModelInfo shows "
               "them), none = batchwire's (temperature 1...), or a folder or "
               "generation_config.json to read them from", metavar="auto|none|PATH")
    add_option(g, "--tool-call-parser", None, "the syntax of the model's own tool calls, read "
               "for tool_choice auto (the default with tools): none refuses auto; unset: the one "
               "the chat template shows (the embedded model: smollm2)", choices=TOOL_CALL_PARSERS)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache and scheduling")
    add_option(g, "--kv-cache-memory", DEFAULTS["kv_cache_memory_bytes"],
               "bytes of KV cache per worker, e.g. 512M or 4G", type=byte_size)
    add_option(g, "--block-size", DEFAULTS["block_size"], "tokens per KV-cache block", type=int)
    add_option(g, "--max-model-len", DEFAULTS["max_model_len"],
               "longest sequence, prompt plus output, in tokens", type=int)
    add_option(g, "--max-num-seqs", DEFAULTS["max_num_seqs"], "most requests running at once",
               type=int)
    add_option(g, "--max-num-batched-tokens", DEFAULTS["max_num_batched_tokens"],
               "token budget of one step", type=int)
    add_option(g, "--max-queued-requests", DEFAULTS["max_queued_requests"],
               "waiting requests beyond this are refused with RESOURCE_EXHAUSTED", type=int)
    add_option(g, "--max-logprobs", DEFAULTS["max_logprobs"],
               "most top-n logprobs a request may ask for", type=int)
    add_option(g, "--max-n", DEFAULTS["max_n"], "most sequences one request may sample (n)",
               type=int)
    add_option(g, "--max-stop-strings", DEFAULTS["max_stop_strings"], "most stop strings (and "
               "bad words) one request may send", type=int)
    add_option(g, "--max-stop-chars", DEFAULTS["max_stop_chars"], "most characters in all of a "
               "request's stop strings (and in all its bad words)", type=int)
    add_option(g, "--max-token-ids", DEFAULTS["max_token_ids"], "most entries in a request's "
               "stop_token_ids, logit_bias and allowed_token_ids, each", type=int)
    add_option(g, "--long-prefill-token-threshold", DEFAULTS["long_prefill_token_threshold"],
               "cut prefills into chunks of at most this many tokens (0 = the step's budget)",
               type=int)
    add_option(g, "--policy", DEFAULTS["policy"], "admission order: first come first served, or "
               "by request priority", choices=POLICIES)
    add_option(g, "--seed", DEFAULTS["seed"], "seeds requests that bring no seed", type=int)
    add_option(g, "--worker-grace-s", DEFAULTS["worker_grace_s"], "seconds requests wait for a "
               "worker to join or return when none is live (the last one died, froze or left) "
               "before failing with UNAVAILABLE; the ones it was running then resume where they "
               "stood (0 = fail at once)", type=float)
    add_flag(g, "--no-prefix-caching", "do not reuse the KV cache of shared prompt prefixes")
    add_flag(g, "--no-chunked-prefill", "run every prompt in one step")
    env = env_name("--async-scheduling")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=env_bool("--async-scheduling"),
                   help="schedule each step while the worker computes the one before (default: "
                   "on for workers in processes of their own without speculative decoding, "
                   f"where it pays; off in process) [{env}=1 or 0]")
    add_speculative_options(p)


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (off unless --speculative-method is given)")
    add_option(g, "--speculative-method", None, "propose draft tokens for running requests and "
               "verify them in one forward pass; ngram: prompt lookup, no draft model",
               choices=("ngram",))
    add_option(g, "--num-speculative-tokens", DEFAULTS["num_speculative_tokens"],
               "most draft tokens per request and step", type=int)
    add_option(g, "--prompt-lookup-min", DEFAULTS["prompt_lookup_min"],
               "shortest suffix the n-gram proposer matches", type=int)
    add_option(g, "--prompt-lookup-max", DEFAULTS["prompt_lookup_max"],
               "longest suffix the n-gram proposer matches (tried first)", type=int)


def add_task_options(p: argparse.ArgumentParser) -> None:
    """What the workers serve, and how their layers are split; passed on to the workers this
    command starts (SchedulerConfig.worker_config), which report it back (GetInfo)."""
    g = p.add_argument_group("task and pipeline")
    add_option(g, "--task", DEFAULTS["task"], "generate tokens, or embed inputs (Generation.Embed)",
               choices=TASKS)
    add_option(g, "--pooling-type", DEFAULTS["pooling_type"], "how an embedding is pooled from "
               "the final hidden states", choices=POOLING_TYPES)
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                   default=env_flag("--normalize", default=True),
                   help="L2-normalise embeddings [BATCHWIRE_NORMALIZE; default: on]")
    add_option(g, "--pipeline-parallel-size", DEFAULTS["pipeline_parallel_size"],
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
    add_option(g, "--max-loras", DEFAULTS["max_loras"], "adapter slots in each worker: most "
               "adapters one step mixes (0: serve none)", type=int)
    add_option(g, "--max-lora-rank", DEFAULTS["max_lora_rank"], "highest adapter rank served",
               type=int)
    add_option(g, "--max-cpu-loras", DEFAULTS["max_cpu_loras"], "adapters each worker keeps "
               "in host memory, least recently used dropped first (0: as many as --max-loras)",
               type=int)


def add_server_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("client API")
    add_option(g, "--host", "127.0.0.1", "address the client, HTTP and metrics ports bind: "
               "loopback, this machine alone, unless told otherwise (0.0.0.0 = every interface; "
               "the container images and manifests set it)")
    add_option(g, "--port", 50051, "gRPC port for clients (0 = any free port)", type=int)
    add_option(g, "--metrics-port", 9090, "Prometheus /metrics port (0 = any free port)", type=int)
    add_flag(g, "--no-metrics", "serve no /metrics")
    add_option(g, "--http-port", 8000, "OpenAI-compatible HTTP API port (/v1/completions, "
               "/v1/chat/completions, ...; 0 = any free port)", type=int)
    add_flag(g, "--no-http", "serve no HTTP API")
    add_flag(g, "--side-ports-fallback", "when the metrics or HTTP port is in use, serve it on a "
             "free port instead of stopping, and say which (make run sets it)")
    # Sized from the model by default: a body larger than the longest prompt that can fit
    # max_model_len only costs memory and event-loop time to read (openai/body.py).
    add_option(g, "--max-request-bytes", None, "largest HTTP request body, e.g. 8M; larger ones "
               "get 413 while still arriving (default: 4 bytes per character of the longest text "
               "prompt that can fit max_model_len, at least 1M)", type=byte_size)
    env = env_name("--served-model-name")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   default=env_default("--served-model-name", "").split(),
                   help="the names /v1/models lists and requests' `model` may use, the first "
                   f"reported back [{env}, space-separated; default: the model's name]")
    add_option(g, "--ready-file", None, "write the bound ports here as JSON once bound")
    add_option(g, "--drain-timeout", None, "seconds requests in flight may take to finish after "
               "SIGTERM or Ctrl-C (a second one stops at once); default: "
               f"{INTERACTIVE_DRAIN_S:.0f} when run from a terminal, where a person waits, "
               f"else {DRAIN_S:.0f}", type=float)
    add_option(g, "--max-message-size", 16 << 20, "largest request or response message, in bytes",
               type=byte_size)
    add_option(g, "--max-connection-age", 600.0, "seconds after which a client connection is "
               "closed (its streams get as long again to finish), so clients rebalance",
               type=float)
    add_option(g, "--log-level", "INFO", "logging level")
    add_flag(g, "--no-progress", "no progress bar while the model loads")
    g = p.add_argument_group("security (PEM files, e.g. a mounted Kubernetes Secret)")
    add_option(g, "--tls-cert", None,
               "serve clients over TLS with this certificate (and --tls-key)")
    add_option(g, "--tls-key", None, "the private key of --tls-cert")
    add_option(g, "--tls-client-ca", None, "require client certificates signed by this CA")
    add_option(g, "--api-key-file", None, "require `authorization: Bearer <key>` on the Generation "
               "service, with a key listed in this file (one a line; read again when it changes)")
    add_option(g, "--health-port", None, "also answer health checks, and nothing else, in "
               "plaintext on this port: Kubernetes' gRPC probes cannot speak TLS", type=int)


def add_worker_tls_options(g: Any) -> None:
    add_option(g, "--worker-tls-ca", None, "dial workers over TLS, trusting this CA (needs "
               "--transport grpc)")
    add_option(g, "--worker-tls-cert", None, "client certificate presented to workers (mutual TLS)")
    add_option(g, "--worker-tls-key", None, "the private key of --worker-tls-cert")
    add_option(g, "--worker-tls-server-name", None, "the name workers' certificates carry, checked "
               "instead of the address dialled (pods are dialled by IP)")


def add_ray_option(g: Any) -> None:
    add_option(g, "--ray-address", None, "with --transport ray: the Ray cluster, host:port "
               "(default: $RAY_ADDRESS, else a local Ray started for this process)")


def add_worker_token_option(g: Any) -> None:
    add_option(g, "--worker-token-file", None, "present the first token of this file (one a line; "
               "read again when it changes) on every call to the workers, both transports; they "
               "must list it in their own --worker-token-file (workers started here get a random "
               "one otherwise)")
