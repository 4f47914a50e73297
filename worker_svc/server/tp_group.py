"""Starts the P x T ranks of a parallel group as child processes and watches them.

Each rank is a whole worker server (`python -m worker_svc --rank r`), r = pp_rank * T + tp_rank;
the scheduler sends every step to every rank and reads the output rank's reply (TP rank 0 of the
last stage, WorkerInfo.output_rank). A group with a dead rank cannot compute anything (its peers
would wait on it in a collective or a stage hand-off), so when one rank exits the others are
stopped too. SIGTERM leaves the scheduler first, then stops the ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from worker_svc.server.serve import write_ready_file

logger = logging.getLogger(__name__)

_READY_POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rank_port(base: int, rank: int) -> int:
    return 0 if base == 0 else base + 2 * rank


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the given options (and their values): the launcher sets them per rank."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_group(args: argparse.Namespace, argv: list[str]) -> int:
    from batchwire.common.key_file import WorkerToken

    from worker_svc.server.registration import SchedulerLink

    try:  # the launcher registers the group: the ranks get neither the address nor its security
        scheduler = SchedulerLink.from_args(args)
        token = WorkerToken.from_file(args.worker_token_file) if args.worker_token_file else None
    except ValueError as e:
        raise SystemExit(f"batchwire worker: {e}") from None
    size = args.tensor_parallel_size * args.pipeline_parallel_size
    init_method = args.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
    common = _strip(
        argv,
        (
            "--port",
            "--zmq-port",
            "--rank",
            "--ready-file",
            "--distributed-init-method",
            "--scheduler-address",
            "--scheduler-tls-ca",
            "--scheduler-tls-cert",
            "--scheduler-tls-key",
            "--scheduler-tls-server-name",
            "--scheduler-api-key-file",
            "--parent-pid",
        ),
    )
    tmp = tempfile.mkdtemp(prefix="batchwire-tp-")
    children: list[subprocess.Popen] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    registration = None
    try:
        for rank in range(size):
            cmd = [
                sys.executable,
                "-m",
                "worker_svc",
                *common,
                "--rank",
                str(rank),
                "--port",
                str(_rank_port(args.port, rank)),
                "--zmq-port",
                str(_rank_port(args.zmq_port, rank)),
                "--distributed-init-method",
                init_method,
                "--ready-file",
                os.path.join(tmp, f"rank{rank}.json"),
                "--parent-pid",
                str(os.getpid()),
            ]
            children.append(subprocess.Popen(cmd))
        ranks = _wait_ready(children, tmp, stop)
        if ranks is None:
            return 1
        if args.ready_file:
            write_ready_file(args.ready_file, {"ranks": ranks, "pid": os.getpid()})
        if scheduler is not None:
            from worker_svc.server.registration import Registration

            registration = Registration(scheduler, args.advertise_host, args.host, ranks, size,
                                        token)
            registration.register()
        logger.info(
            "group of %d stage(s) x %d rank(s) serving",
            args.pipeline_parallel_size,
            args.tensor_parallel_size,
        )
        while not stop.wait(0.5):
            if args.parent_pid is not None and os.getppid() != args.parent_pid:
                logger.warning("the process that started this group is gone: stopping")
                return 0
            dead = [c for c in children if c.poll() is not None]
            if dead:
                logger.error(
                    "rank %d exited (%s): stopping the group",
                    children.index(dead[0]),
                    dead[0].returncode,
                )
                return 1
        return 0
    finally:
        if registration is not None:
            registration.deregister()
        _stop_children(children)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(
    children: list[subprocess.Popen], tmp: str, stop: threading.Event
) -> list[dict] | None:
    ranks: dict[int, dict] = {}
    while len(ranks) < len(children):
        if stop.is_set():
            return None
        for rank, child in enumerate(children):
            path = os.path.join(tmp, f"rank{rank}.json")
            if rank not in ranks and os.path.exists(path):
                with open(path) as f:
                    ranks[rank] = json.load(f)["ranks"][0]
            if child.poll() is not None:
                logger.error("rank %d exited with %s while starting", rank, child.returncode)
                return None
        time.sleep(_READY_POLL_S)
    return [ranks[r] for r in range(len(children))]


def _stop_children(children: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
