"""One replica's engine: a scheduler (this process) and the executor of one worker group.

A step is the walkthrough's: schedule, send the forward pass, build the grammar bitmask while it
runs, and if the logits were parked (the reply is None) ask for the sampled tokens; then update
the requests. It is split into three calls so that the replicated engine can send every
replica's forward pass before reading any result, with the step itself written once, here.

The engine holds no model and makes no decision of its own. It keeps the one map from the
client's request id to the request; below it, the scheduler knows requests by their wire id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.errors import RequestIdInUseError
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.executors.base import Executor


@dataclasses.dataclass(slots=True)
class StepInFlight:
    """A step between its calls: the scheduler's decision and the worker's pending replies."""

    so: worker_pb2.SchedulerOutput
    forward: Future  # execute_model's reply: None (logits parked) or a ModelRunnerOutput
    sampled: Any = None  # sample_tokens' reply (a Future), or the forward pass's own output


class EngineCore:
    """Not thread-safe: a server calls add_request, abort_requests and step from one thread."""

    def __init__(self, config: SchedulerConfig, executor: Executor | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.executor = executor if executor is not None else Executor.get_class(config)(config)
        self.info: worker_pb2.WorkerInfo = self.executor.get_info()
        self.scheduler = scheduler_for(config, self.info, tokenizer)
        self.requests: dict[str, Request] = {}  # the client's request id -> unfinished request


    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    request_id: str | None = None, **kwargs: Any) -> Request:
        """Validates and queues a request (Scheduler.add_request's keywords pass through)."""
        if request_id is not None and request_id in self.requests:
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        request = self.scheduler.add_request(prompt_token_ids, sampling_params,
                                             request_id=request_id, **kwargs)
        self.requests[request.request_id] = request
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Ends the requests now (finish_reason "abort"); unknown or finished ids are skipped."""
        found = [self.requests[i] for i in request_ids if i in self.requests]
        return self._forget_finished(self.scheduler.abort_requests(found))

    def remove_request(self, request: Request) -> None:
        """Takes a request out without an output for its client: it moved to another replica."""
        self.scheduler.abort_requests([request])
        self.requests.pop(request.request_id, None)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()


    def step(self) -> list[EngineCoreOutput]:
        step = self.launch_step()
        if step is None:
            return []
        self.sample_step(step)
        return self.finish_step(step)

    def launch_step(self) -> StepInFlight | None:
        """Schedules and sends the forward pass; None when there is nothing to do."""
        if not self.scheduler.has_requests():
            return None
        so = self.scheduler.schedule()
        return StepInFlight(so, self.executor.execute_model(so, non_block=True))

    def sample_step(self, step: StepInFlight) -> None:
        """Builds the grammar bitmask while the forward pass runs, then, if the logits were
        parked, sends the second call."""
        grammar_output = self.scheduler.get_grammar_bitmask(step.so)
        model_output = step.forward.result()
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output, non_block=True)
        step.sampled = model_output

    def finish_step(self, step: StepInFlight) -> list[EngineCoreOutput]:
        """Reads the sampled tokens and updates the requests: stop checks, text, freed blocks."""
        model_output = step.sampled
        if isinstance(model_output, Future):
            model_output = model_output.result()
        return self._forget_finished(self.scheduler.update_from_output(step.so, model_output))

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs


def scheduler_for(config: SchedulerConfig, info: worker_pb2.WorkerInfo,
                  tokenizer: Any = None) -> Scheduler:
    """The scheduler of one worker group, sized by what the group reported (GetInfo): its KV
    blocks, vocabulary and limits. The tokenizer's EOS counts as well as the model's."""
    eos = set(info.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None:
        eos.add(tokenizer_eos)
    return Scheduler(config, num_blocks=info.num_blocks, block_size=info.block_size,
                     vocab_size=info.vocab_size, eos_token_ids=eos,
                     max_model_len=info.max_model_len or None,
                     max_num_seqs=info.max_num_reqs or None, tokenizer=tokenizer)
