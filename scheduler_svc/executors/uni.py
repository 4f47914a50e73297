"""The in-process executor: one worker in this process, called as a function. The only module of
scheduler_svc that imports worker_svc (and so torch), and only when it builds the worker."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.base import Executor


def build_worker(worker_config: Any) -> Any:
    """A worker_svc Worker in this process (a WorkerConfig in; loads torch and the model)."""
    from worker_svc.runner.worker import Worker  # only when used

    return Worker(worker_config)


class UniProcExecutor(Executor):
    """A function call dressed as an RPC. Its futures are already resolved when returned, and a
    worker's exception is put inside the future so that it surfaces from future.result(), where
    a remote executor's would."""

    def __init__(self, config: SchedulerConfig, worker: Any = None) -> None:
        super().__init__(config)
        if worker is None:
            if config.world_size > 1:
                raise ValueError("the uni executor runs one worker in this process; a parallel "
                                 f"group ({config.world_size} ranks) needs the zmq or grpc "
                                 "executor")
            worker = build_worker(config.worker_config())
        self.worker = worker

    @classmethod
    def connect(cls, config: SchedulerConfig, addresses: Sequence[str]) -> Executor:
        raise ValueError("the uni executor runs its worker in this process: it dials no address "
                         f"(asked for {list(addresses)}); use the zmq or grpc executor")

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        if not non_block:
            result = getattr(self.worker, method)(*args)
            return result if unique_reply_rank is not None else [result]
        future: Future = Future()
        try:
            result = getattr(self.worker, method)(*args)
            future.set_result(result if unique_reply_rank is not None else [result])
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        close = getattr(self.worker, "shutdown", None)  # a test's stand-in worker may have none
        if close is not None:
            close()
