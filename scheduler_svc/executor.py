"""How a step reaches the workers. The executor holds no model and decides nothing: it carries a
method name and arguments to every worker of the group and brings back one rank's answer.

Executor.get_class picks the transport once, at start-up; the engine loop is the same line of code
whichever it picked.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig

# Transports by name -> where their class lives. The remote ones arrive with issue 4; until their
# module exists, asking for them is a clear error rather than an ImportError from deep inside.
_BACKENDS = {
    "uni": "scheduler_svc.executor.UniProcExecutor",
    "grpc": "scheduler_svc.grpc_executor.GrpcExecutor",
    "zmq": "scheduler_svc.zmq_executor.ZmqExecutor",
}


class ExecutorNotAvailableError(NotImplementedError):
    """A known transport whose implementation is not in this build."""


class Executor(ABC):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: SchedulerConfig) -> type[Executor]:
        backend: Any = config.executor_backend
        if backend == "auto":
            remote = config.worker_addresses or config.tensor_parallel_size > 1
            backend = "zmq" if remote else "uni"
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(
                    f"executor_backend {backend.__qualname__} is not an Executor subclass")
            return backend
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"executor_backend must be one of {sorted(_BACKENDS)} or a qualified "
                             f"class name, got {backend!r}")
        qualname = _BACKENDS.get(backend, backend)
        module_name, _, class_name = qualname.rpartition(".")
        if not module_name:
            raise ValueError(f"unknown executor_backend {backend!r}: use one of "
                             f"{sorted(_BACKENDS)} or a qualified class name like 'pkg.mod.Class'")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if backend in _BACKENDS and e.name == module_name:
                raise ExecutorNotAvailableError(
                    f"executor_backend {backend!r} is not implemented yet (issue 4); "
                    "use 'uni'") from e
            raise ValueError(
                f"executor_backend {backend!r}: cannot import {module_name}: {e}") from e
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ValueError(f"executor_backend {backend!r}: {module_name} has no {class_name}")
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"executor_backend {backend!r} is not an Executor subclass")
        return cls

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Calls `method(*args)` on every worker. Returns the list of their results, or only
        rank `unique_reply_rank`'s; wrapped in a Future when `non_block`. A failure on any rank
        surfaces at the same point: from the call, or from future.result()."""

    def execute_model(self, so: worker_pb2.SchedulerOutput, non_block: bool = False) -> Any:
        """The forward pass. Its result is None when the logits were parked for sample_tokens."""
        return self.collective_rpc("execute_model", (so,), non_block, unique_reply_rank=0)

    def sample_tokens(self, grammar_output: worker_pb2.GrammarOutput | None
                      ) -> worker_pb2.ModelRunnerOutput:
        return self.collective_rpc("sample_tokens", (grammar_output,), unique_reply_rank=0)

    def get_info(self) -> worker_pb2.WorkerInfo:
        return self.collective_rpc("get_info", unique_reply_rank=0)

    def shutdown(self) -> None:  # noqa: B027 - optional: not every transport holds resources
        """Releases the workers; the default has nothing to release."""


class UniProcExecutor(Executor):
    """One worker in this process: a function call dressed as an RPC. Its futures are already
    resolved when returned, and a worker's exception is put inside the future so that it
    surfaces from future.result(), where a remote executor's would."""

    def __init__(self, config: SchedulerConfig, worker: Any = None) -> None:
        super().__init__(config)
        if worker is None:
            from worker_svc.worker import Worker  # loads torch and the model: only when used

            worker = Worker(config.worker_config())
        self.worker = worker

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
        close = getattr(self.worker, "shutdown", None)
        if close is not None:
            close()
