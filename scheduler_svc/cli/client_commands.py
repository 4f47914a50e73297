"""`batchwire generate` and `batchwire chat`: clients of a running server, over its gRPC API."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from scheduler_svc.cli.client import DEFAULT_ADDRESS

CONNECT_TIMEOUT_S = 10.0  # chat checks the server is there before the first prompt (default)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    # Imported here: sampling_flags loads the protobuf code, which serve and worker never need.
    from scheduler_svc.cli.sampling_flags import add_sampling_options

    add_sampling_options(p)


def add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("BATCHWIRE_ADDRESS", DEFAULT_ADDRESS),
                   help="the server, host:port [BATCHWIRE_ADDRESS; default: %(default)s]")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds the whole request may take (default: no limit)")
    p.add_argument("--tls", action="store_true", help="connect over TLS (the system's CAs)")
    p.add_argument("--tls-ca", default=os.environ.get("BATCHWIRE_TLS_CA"),
                   help="connect over TLS, trusting this CA (PEM) [BATCHWIRE_TLS_CA]")
    p.add_argument("--api-key-file", default=os.environ.get("BATCHWIRE_API_KEY_FILE"),
                   help="send the file's first key as `authorization: Bearer <key>` "
                   "[BATCHWIRE_API_KEY_FILE; or the key itself in BATCHWIRE_API_KEY]")


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH of --lora-modules (serve, scheduler and generate alike)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def add_lora_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (the server's, started with --max-loras N)")
    g.add_argument("--lora-name", metavar="NAME", help="generate with this adapter of the "
                   "server (default: the base model, or the one adapter --lora-modules names)")
    # One NAME=PATH a flag (repeat it for more), unlike serve's list: a list would swallow the
    # prompt that follows it.
    g.add_argument("--lora-modules", action="append", default=[], metavar="NAME=PATH",
                   type=lora_module, help="load this adapter on the server first (repeatable), "
                   "PATH a PEFT folder the server can read; one loaded already from the same "
                   "path is used as it is; it stays loaded for later requests")


def _lora_name(client: Any, args: argparse.Namespace) -> str:
    """Loads --lora-modules on the server; the adapter to generate with ("" = the base)."""
    modules = dict(args.lora_modules)
    if args.lora_name is None and len(modules) > 1:
        raise SystemExit("batchwire generate: --lora-modules names several adapters: "
                         "--lora-name picks the one to generate with")
    if modules:
        client.load_lora_adapters(modules)
    return args.lora_name if args.lora_name is not None else next(iter(modules), "")


def _client(args: argparse.Namespace) -> Any:
    from batchwire.common.tls import ClientTls

    from scheduler_svc.cli.client import GenerationClient
    from scheduler_svc.service.security import parse_keys

    key = os.environ.get("BATCHWIRE_API_KEY") or None
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                keys = parse_keys(f.read())
                key = keys[0] if keys else None
        except OSError as e:
            raise SystemExit(f"batchwire: cannot read {args.api_key_file!r}: "
                             f"{e.strerror}") from None
    try:
        tls = ClientTls.from_options(args.tls_ca) or (ClientTls() if args.tls else None)
    except ValueError as e:
        raise SystemExit(f"batchwire: {e}") from None
    return GenerationClient(args.address, tls, key)


def _sampling(args: argparse.Namespace) -> Any:
    from scheduler_svc.cli.sampling_flags import sampling_message

    return sampling_message(args)


def _stream(client: Any, request: Any, timeout: float | None) -> tuple[str, Any]:
    """Prints the text as it arrives, then any logprobs asked for (on stderr); returns the text
    and the last message."""
    text, last, logprobs = [], None, []
    for last in client.generate(request, timeout):
        text.append(last.text)
        logprobs.extend(last.logprobs)
        print(last.text, end="", flush=True)
    print()
    for lp in logprobs:
        top = " ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top_logprobs)
        print(f"[logprob] token {lp.token_id}: {lp.logprob:.3f} (rank {lp.rank}) {top}".rstrip(),
              file=sys.stderr)
    return "".join(text), last


def _usage_line(last: Any) -> str:
    u = last.usage
    return (f"[{last.finish_reason}: {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
            f"{u.completion_tokens} generated]")


def cmd_generate(args: argparse.Namespace) -> int:
    from batchwire.v1 import generate_pb2

    if args.system and args.raw:
        raise SystemExit("batchwire generate: --system needs the chat template, which --raw "
                         "turns off")
    # A prompt piped in ends with the newline of its last line, which is not part of the prompt.
    prompt = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    with _client(args) as client:
        # An instruct model answers a prompt sent through its chat template; raw text it only
        # continues. So the template applies whenever the model has one, unless --raw.
        chat = args.chat or (not args.raw and client.model_info().has_chat_template)
        if args.system and not chat:
            raise SystemExit("batchwire generate: --system needs a model with a chat template")
        if chat:
            messages = [("system", args.system)] if args.system else []
            request = client.chat_request([*messages, ("user", prompt)], _sampling(args))
        else:
            request = generate_pb2.GenerateRequest(text=prompt, sampling=_sampling(args))
        request.lora_name = _lora_name(client, args)
        _, last = _stream(client, request, args.timeout)  # errors: client_errors.run_client
    if last is not None and not args.quiet:
        print(_usage_line(last), file=sys.stderr)
    return 0


def _cut_note(last: Any) -> str | None:
    if last is None or last.finish_reason != "length":
        return None
    return (f"[cut at max_tokens, after {last.usage.completion_tokens} tokens: --max-tokens "
            "raises the limit]")


def cmd_chat(args: argparse.Namespace) -> int:
    import grpc

    from scheduler_svc.cli.sampling_flags import defaults_line

    history: list[tuple[str, str]] = [("system", args.system)] if args.system else []
    print("Chatting with the model at " + args.address + ". /reset forgets the conversation, "
          "/exit or Ctrl-D leaves.", file=sys.stderr)
    with _client(args) as client:
        client.wait_ready(args.connect_timeout)
        print(defaults_line(client.model_info()) + " Flags override them.", file=sys.stderr)
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history = history[:1] if args.system else []
                continue
            if not line:
                continue
            history.append(("user", line))
            print("model> ", end="", flush=True)
            try:
                reply, last = _stream(client, client.chat_request(history, _sampling(args)),
                                      args.timeout)
                note = _cut_note(last)
                if note:
                    print(note, file=sys.stderr)
            except grpc.RpcError as e:
                print(f"\nbatchwire chat: {e.code().name}: {e.details()}", file=sys.stderr)
                history.pop()
                continue
            except KeyboardInterrupt:  # stop this reply (the stream is cancelled), keep chatting
                print(file=sys.stderr)
                history.pop()
                continue
            history.append(("assistant", reply))
