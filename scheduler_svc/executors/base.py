"""How a step reaches the workers. The executor holds no model and decides nothing: it carries a
method name and arguments to every worker of the group and brings back one rank's answer.

Executor.get_class picks the transport once, at start-up; the engine loop is the same line of code
whichever it picked.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig

# Transports by name -> where their class lives.
_BACKENDS = {
    "uni": "scheduler_svc.executors.uni.UniProcExecutor",
    "grpc": "scheduler_svc.executors.grpc_executor.GrpcExecutor",
    "zmq": "scheduler_svc.executors.zmq_executor.ZmqExecutor",
    "ray": "scheduler_svc.executors.ray_executor.RayExecutor",
    "external_launcher": "scheduler_svc.executors.external_launcher.ExternalLauncherExecutor",
}


class Executor(ABC):
    # Which of a worker rank's ports this executor dials ("grpc" or "zmq"); "" for none (the
    # worker is in this process). Registration and discovery read it to pick the address.
    transport: ClassVar[str] = ""

    def __init__(self, config: SchedulerConfig, addresses: Sequence[str] | None = None) -> None:
        """addresses: one "host:port" per rank of the group, in rank order; None: the group the
        config names, or one this executor starts (remote), or the worker in this process."""
        self.config = config
        self.addresses: list[str] = list(addresses) if addresses is not None else []
        # The rank whose replies carry the step's output: TP rank 0 of the last pipeline stage
        # (WorkerInfo.output_rank); the other ranks' replies are waited for, not read.
        self.output_rank = 0

    @classmethod
    def connect(cls, config: SchedulerConfig, addresses: Sequence[str]) -> Executor:
        """An executor of this class for the group at `addresses` (registration, discovery)."""
        return cls(config, addresses)

    @staticmethod
    def get_class(config: SchedulerConfig) -> type[Executor]:
        backend: Any = config.executor_backend
        if backend == "auto":
            remote = config.worker_addresses or config.world_size > 1
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
            raise ValueError(
                f"executor_backend {backend!r}: cannot import {module_name}: {e}") from e
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ValueError(f"executor_backend {backend!r}: {module_name} has no {class_name}")
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"executor_backend {backend!r} is not an Executor subclass")
        return cls

    @property
    def failed(self) -> bool:
        """True once a worker of the group died or stopped answering; the group is then unusable
        and its requests must move (the replicated engine drops it)."""
        return False

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
        return self.collective_rpc("execute_model", (so,), non_block,
                                   unique_reply_rank=self.output_rank)

    def sample_tokens(self, grammar_output: worker_pb2.GrammarOutput | None,
                      non_block: bool = False) -> Any:
        """The second call of a step: a ModelRunnerOutput (in a Future when `non_block`)."""
        return self.collective_rpc("sample_tokens", (grammar_output,), non_block,
                                   unique_reply_rank=self.output_rank)

    def get_info(self) -> worker_pb2.WorkerInfo:
        """The output rank's WorkerInfo."""
        return self.collective_rpc("get_info", unique_reply_rank=self.output_rank)

    def get_infos(self) -> list[worker_pb2.WorkerInfo]:
        """Every rank's WorkerInfo, in rank order (pipeline stages may hold different pools)."""
        return self.collective_rpc("get_info")

    def shutdown(self) -> None:  # noqa: B027 - optional: not every transport holds resources
        """Releases the workers; the default has nothing to release."""
