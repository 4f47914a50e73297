"""The executor for a job that torchrun started (`executor_backend="external_launcher"`): RL
trainers and other frameworks run inference inside their own `torchrun --nproc-per-node R`.

Every rank runs the same script, so the same engine and scheduler on the same inputs; its worker
is rank RANK of the P x T group, in this process, with torch.distributed from torchrun's
environment (env://; gloo on CPU, NCCL on CUDA). The schedulers stay in step because every rank
returns the output rank's step result (Worker.share_output): a stage before the last sends its
hidden states on, parks no logits of its own, and still takes part in sample_tokens, where the
last stage's result is broadcast. Their block pools agree because every rank sizes its scheduler
from all ranks' WorkerInfo (gathered), as a remote group's scheduler does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.uni import UniProcExecutor, build_worker


def torchrun_rank(config: SchedulerConfig) -> int:
    """This process's rank, from torchrun's environment, checked against the config's group."""
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ValueError("executor_backend='external_launcher' runs under torchrun, which sets "
                         f"RANK and WORLD_SIZE: {e!r}") from None
    if world_size != config.world_size:
        raise ValueError(f"torchrun started {world_size} processes, and pipeline_parallel_size "
                         f"{config.pipeline_parallel_size} x tensor_parallel_size "
                         f"{config.tensor_parallel_size} = {config.world_size} ranks are asked")
    return rank


class ExternalLauncherExecutor(UniProcExecutor):
    def __init__(self, config: SchedulerConfig, worker: Any = None) -> None:
        if config.async_scheduling:
            raise ValueError("the external launcher steps every rank in lockstep: "
                             "async_scheduling must be off")
        rank = torchrun_rank(config)
        if worker is None:
            worker = build_worker(dataclasses.replace(
                config.worker_config(), rank=rank, distributed_init_method="env://"))
        super().__init__(config, worker)
        self.rank = rank
        self.infos: list[worker_pb2.WorkerInfo] = self.worker.group_infos()
        self.output_rank = self.infos[0].output_rank

    def get_info(self) -> worker_pb2.WorkerInfo:
        return self.infos[self.output_rank]

    def get_infos(self) -> list[worker_pb2.WorkerInfo]:
        return list(self.infos)

    def execute_model(self, so: worker_pb2.SchedulerOutput, non_block: bool = False) -> Any:
        return _maybe_future(lambda: self._execute_model(so), non_block)

    def sample_tokens(self, grammar_output: worker_pb2.GrammarOutput | None,
                      non_block: bool = False) -> Any:
        return _maybe_future(
            lambda: self.worker.share_output(self.worker.sample_tokens(grammar_output)),
            non_block)

    def _execute_model(self, so: worker_pb2.SchedulerOutput) -> Any:
        out = self.worker.execute_model(so)
        if so.total_num_scheduled_tokens == 0:
            return out  # the same empty output on every rank, nothing to share
        if self.infos[0].task == "embed":  # pooled now on the last stage: nothing is parked
            return self.worker.share_output(out)
        # The last stage parked its logits (None); the others handed their hidden states on.
        # Every rank then calls sample_tokens, where the last stage's result is shared.
        return None

    def shutdown(self) -> None:
        super().shutdown()
        # Every rank runs the same script, so every rank shuts down here: they leave the group
        # together rather than at the interpreter's exit, where gloo's teardown in one rank
        # while a peer still sends aborted a rank (SIGABRT) in a fresh-clone run.
        self.worker.leave_group()

    def collective_rpc(self, method: str | Callable, args: tuple = (), non_block: bool = False,
                       unique_reply_rank: int | None = None) -> Any:
        """A method name of the worker, or a function called as function(worker, *args), on
        this rank (every rank runs the same call)."""
        if callable(method):
            return _maybe_future(lambda: [method(self.worker, *args)], non_block)
        return super().collective_rpc(method, args, non_block, unique_reply_rank)


def _maybe_future(call: Callable[[], Any], non_block: bool) -> Any:
    if not non_block:
        return call()
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as e:  # surfaces from future.result(), as a remote executor's would
        future.set_exception(e)
    return future
