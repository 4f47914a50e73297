"""`python -m worker_svc` (also `batchwire worker`): one worker, or a parallel group of them.

With --pipeline-parallel-size P and/or --tensor-parallel-size T and no --rank, this process starts
the P x T ranks as child processes (rank r on the given ports + 2r) and watches them; with --rank
it is that one rank. Ranks are numbered stage-major: rank = pp_rank * T + tp_rank.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from worker_svc.server.options import build_parser, worker_config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # the settings checked before any rank starts: a group of them fails as one line
        worker_config(args, int(args.rank or 0), args.distributed_init_method)
    except ValueError as e:
        raise SystemExit(f"batchwire worker: {e}") from None
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and args.rank is None:
        from worker_svc.server.tp_group import run_group

        return run_group(args, argv if argv is not None else sys.argv[1:])
    return run_one(args)


def run_one(args: argparse.Namespace) -> int:
    from batchwire.common.key_file import WorkerToken
    from batchwire.common.ports import PortInUseError
    from batchwire.common.tls import ServerTls

    from worker_svc.server.registration import SchedulerLink
    from worker_svc.server.serve import LoadInterrupted, ServeOptions, serve

    rank = int(args.rank or 0)
    config = worker_config(args, rank, args.distributed_init_method)
    try:
        tls = ServerTls.from_options(args.tls_cert, args.tls_key, args.tls_ca)
        token = WorkerToken.from_file(args.worker_token_file) if args.worker_token_file else None
        scheduler = SchedulerLink.from_args(args)
    except ValueError as e:
        raise SystemExit(f"batchwire worker: {e}") from None
    options = ServeOptions(
        host=args.host,
        grpc_port=args.port,
        zmq_port=args.zmq_port,
        ready_file=args.ready_file,
        scheduler=scheduler,
        advertise_host=args.advertise_host,
        tls=tls,
        token=token,
        health_port=int(args.health_port) if args.health_port is not None and rank == 0 else None,
        zmq=not args.no_zmq,
        parent_pid=args.parent_pid,
        scheduler_lost_s=args.scheduler_lost_s,
        metrics_port=None
        if args.no_metrics
        else (args.metrics_port + rank if args.metrics_port else 0),
    )
    try:
        asyncio.run(serve(config, options))
    except PortInUseError as e:
        print(f"batchwire worker: {e.strerror}", file=sys.stderr)
        return 1
    except LoadInterrupted:
        logging.getLogger(__name__).info("stopped before the model was loaded")
        logging.shutdown()
        os._exit(0)  # the loading thread cannot be joined
    return 0


if __name__ == "__main__":
    sys.exit(main())
