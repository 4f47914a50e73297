"""How a client command (generate, chat) ends when it cannot finish: one line on stderr and a
non-zero exit status, never a traceback. Ctrl-C cancels the stream (the server aborts the request)
and exits 130, as shells expect of a command ended by SIGINT."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import grpc

from scheduler_svc.cli.client import with_default_port

EXIT_INTERRUPTED = 130


def rpc_error_line(command: str, address: str, error: grpc.RpcError) -> str:
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (details or "").lower():
        return (f"batchwire {command}: cannot reach a server at {with_default_port(address)} "
                f"(is one running? --address HOST:PORT names another): {details}")
    return f"batchwire {command}: {code.name}: {details}"


def run_client(command: str, fn: Callable[[argparse.Namespace], int],
               args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except KeyboardInterrupt:
        print(flush=True)  # end the partial line of streamed text
        print(f"batchwire {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except grpc.RpcError as e:
        print(flush=True)
        print(rpc_error_line(command, args.address, e), file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"batchwire {command}: {e}", file=sys.stderr)
        return 1
