"""One replica's engine: a scheduler (this process) and the executor of one worker group.

A step is the walkthrough's: schedule, send the forward pass, build the grammar bitmask while it
runs, and if the logits were parked (the reply is None) ask for the sampled tokens; then update
the requests. It is split into three calls so that the replicated engine can send every
replica's forward pass before reading any result, with the step itself written once, here.

With async scheduling the update of step N moves after the launch of step N+1: launch_step
schedules N+1 (each request sampling in N counted one token ahead), reads N's reply and sends
N+1's forward pass; apply_in_flight updates the requests from N's tokens while the worker runs
N+1; sample_step builds N+1's grammar bitmask from matchers N's tokens advanced and asks for
N+1's tokens, which the next step reads. The worker never has two calls pending: N's reply
is read before N+1 is sent.

The step itself is token-level: its outputs carry token ids, and text and stop strings are the
output processor's (core/output_processor.py). step(), the offline path, runs process_outputs()
over each step's outputs, which makes the text inline and stops the requests a stop string
ended (with async scheduling, while the worker computes the next forward pass); a server's
ReplicatedEngine steps its cores call by call and leaves the text to the AsyncEngine's event
loop.

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
from scheduler_svc.core.output_processor import OutputProcessor, Stops
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.pooling import prefix_caching_allowed
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_refusal import drop_refused, fail_refused, refused_in_step
from scheduler_svc.executors.base import Executor
from scheduler_svc.executors.errors import step_refusal


@dataclasses.dataclass(slots=True)
class StepInFlight:
    """A step between its calls: the scheduler's decision and the worker's pending replies."""

    so: worker_pb2.SchedulerOutput
    forward: Future  # execute_model's reply: None (logits parked) or a ModelRunnerOutput
    sampled: Any = None  # sample_tokens' reply (a Future), or the forward pass's own output
    grammar: worker_pb2.GrammarOutput | None = None  # what sample_tokens was sent

    def output(self) -> worker_pb2.ModelRunnerOutput:
        if isinstance(self.sampled, Future):
            self.sampled = self.sampled.result()
        return self.sampled


class EngineCore:
    """Not thread-safe: a server calls add_request, abort_requests and step from one thread."""

    def __init__(self, config: SchedulerConfig, executor: Executor | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.executor = executor if executor is not None else Executor.get_class(config)(config)
        # The output rank's info, its pool shrunk to the stage with the fewest blocks.
        self.info: worker_pb2.WorkerInfo = group_info(self.executor.get_infos(),
                                                      self.executor.output_rank)
        self.scheduler = scheduler_for(config, self.info, tokenizer,
                                       remote=bool(self.executor.transport))
        self.requests: dict[str, Request] = {}  # the client's request id -> unfinished request
        self.async_scheduling = self.scheduler.async_scheduling
        self.in_flight: StepInFlight | None = None  # async: sampled, its tokens not yet applied
        self._refused: list[EngineCoreOutput] = []  # requests the worker refused, to report
        # step()'s text, inline; None without a tokenizer, and for a core that a replicated
        # engine steps (its caller makes the text).
        self.output_processor = OutputProcessor(tokenizer) if tokenizer is not None else None


    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    request_id: str | None = None, **kwargs: Any) -> Request:
        """Validates and queues a request (Scheduler.add_request's keywords pass through)."""
        if request_id is not None and request_id in self.requests:
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        request = self.scheduler.add_request(prompt_token_ids, sampling_params,
                                             request_id=request_id, **kwargs)
        self.requests[request.request_id] = request
        if self.output_processor is not None and request.pooling is None:
            self.output_processor.add_request(request.request_id, request.prompt_token_ids,
                                              sampling_params)
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Ends the requests now (finish_reason "abort"); unknown or finished ids are skipped."""
        found = [self.requests[i] for i in request_ids if i in self.requests]
        return self.process_outputs(self._forget_finished(self.scheduler.abort_requests(found)))

    def stop_requests(self, stops: Stops) -> list[EngineCoreOutput]:
        """Ends the requests a stop string ended in the output processor (client id -> (output
        tokens its client got, the stop string)); their outputs confirm the end."""
        found = [(self.requests[i], n, s) for i, (n, s) in stops.items() if i in self.requests]
        return self._forget_finished(self.scheduler.stop_requests(found))

    def remove_request(self, request: Request) -> None:
        """Takes a request out without an output for its client: it moved to another replica."""
        self.scheduler.abort_requests([request])
        self.requests.pop(request.request_id, None)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or self.in_flight is not None


    def step(self) -> list[EngineCoreOutput]:
        """One step, then its text (the offline path). Async: the text of the step before is
        made while the worker runs this one's forward pass (a stop string found there ends its
        request before this step samples, whose token for it is then dropped, as for EOS)."""
        step = self.launch_step()
        outputs = self.process_outputs(self.apply_in_flight())
        self.sample_step(step)
        return outputs + self.process_outputs(self.finish_step(step))

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The output processor over outputs, inline; a request a stop string ended stops now,
        before the next step is scheduled."""
        if self.output_processor is None:
            return outputs
        outputs, stops = self.output_processor.process(outputs)
        if stops:
            self.output_processor.process(self.stop_requests(stops))  # confirmations: dropped
        return outputs

    def launch_step(self) -> StepInFlight | None:
        """Schedules and sends the forward pass; None when there is nothing to schedule."""
        if not self.scheduler.has_requests():
            return None
        so = self.scheduler.schedule()
        if self.in_flight is not None:
            self._sampled_output(self.in_flight)  # read before the next call: one call pending
        return StepInFlight(so, self.executor.execute_model(so, non_block=True))

    def apply_in_flight(self) -> list[EngineCoreOutput]:
        """Async: updates the requests from the step before's tokens, while the worker runs the
        step just launched; their outputs. Nothing to do without async scheduling."""
        step, self.in_flight = self.in_flight, None
        return [] if step is None else self._apply(step)

    def sample_step(self, step: StepInFlight | None) -> None:
        """Builds the grammar bitmask while the forward pass runs, then, if the logits were
        parked, sends the second call."""
        if step is None:
            return
        grammar_output = self.scheduler.get_grammar_bitmask(step.so)
        model_output, refused = self._forward_output(step)
        if refused:  # the step changed: its bitmask rows too
            grammar_output = self.scheduler.get_grammar_bitmask(step.so)
        if model_output is None:
            step.grammar = grammar_output
            model_output = self.executor.sample_tokens(grammar_output, non_block=True)
        step.sampled = model_output

    def _forward_output(self, step: StepInFlight) -> tuple[Any, bool]:
        """The forward pass's reply, and whether the worker refused some of the step's requests
        first: they fail, and the step goes again without them (core/step_refusal.py), until
        it is accepted. A refusal about no request of the step is the step's own: it raises."""
        refused_any = False
        while True:
            try:
                return step.forward.result(), refused_any
            except Exception as e:
                refusal = step_refusal(e)
                refused = [] if refusal is None else refused_in_step(step.so, refusal[1])
                if not refused:
                    raise
                assert refusal is not None
                step.so, outputs = drop_refused(self.scheduler, step.so, refused, refusal[0])
                self._refused += self._forget_finished(outputs)
                refused_any = True
                step.forward = self.executor.execute_model(step.so, non_block=True)

    def _sampled_output(self, step: StepInFlight) -> worker_pb2.ModelRunnerOutput:
        """The sampled tokens. A SampleTokens refused for some requests' grammar bitmask rows
        leaves the logits parked: those requests fail, and the bitmask goes again without their
        rows (the worker samples them unconstrained; their tokens are dropped as for an abort)."""
        while True:
            try:
                return step.output()
            except Exception as e:
                refusal = step_refusal(e)
                rows = list(step.grammar.req_ids) if step.grammar is not None else []
                named = [] if refusal is None else refusal[1] or [
                    r.req_id for r in step.so.scheduled_new_reqs]
                refused = [r for r in named if r in rows]
                if refusal is None or not refused:
                    raise
                self._refused += self._forget_finished(
                    fail_refused(self.scheduler, refused, refusal[0]))
                step.grammar = self.scheduler.get_grammar_bitmask(step.so)
                step.sampled = self.executor.sample_tokens(step.grammar, non_block=True)

    def take_refused(self) -> list[EngineCoreOutput]:
        """The last outputs of the requests the worker refused since the last finish_step (a
        replica that fails mid-step still ends them)."""
        refused, self._refused = self._refused, []
        return refused

    def finish_step(self, step: StepInFlight | None) -> list[EngineCoreOutput]:
        """Reads the sampled tokens and updates the requests: stop checks, text, freed blocks.
        Async: the step stays in flight, applied by the next apply_in_flight. The requests the
        worker refused in this step end here."""
        refused = self.take_refused()
        if step is None:
            return refused
        if self.async_scheduling:
            self.in_flight = step
            return refused
        return refused + self._apply(step)

    def _apply(self, step: StepInFlight) -> list[EngineCoreOutput]:
        output = self._sampled_output(step)
        return self._forget_finished(self.scheduler.update_from_output(step.so, output))

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs


def group_info(infos: Sequence[worker_pb2.WorkerInfo], output_rank: int) -> worker_pb2.WorkerInfo:
    """One WorkerInfo for a group: the output rank's, with the fewest KV blocks of any rank (a
    block id must be valid on every pipeline stage, each of which holds its own layers' cache)."""
    info = worker_pb2.WorkerInfo()
    info.CopyFrom(infos[output_rank])
    info.num_blocks = min(i.num_blocks for i in infos)
    return info


def scheduler_for(config: SchedulerConfig, info: worker_pb2.WorkerInfo,
                  tokenizer: Any = None, remote: bool = False) -> Scheduler:
    """The scheduler of one worker group, sized by what the group reported (GetInfo): its KV
    blocks, vocabulary, limits and task. The tokenizer's EOS counts as well as the model's."""
    eos = set(info.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None:
        eos.add(tokenizer_eos)
    task = info.task or "generate"
    if config.enable_prefix_caching and not prefix_caching_allowed(task, info.pooling_type):
        config = dataclasses.replace(config, enable_prefix_caching=False)
    # Async scheduling needs a worker that holds what it sampled: pipeline stages before the
    # last learn each token from the scheduler, and a pooling step samples nothing. Unset, it
    # is on where it pays: a remote group (`remote`: the worker computes in another process
    # while this one schedules), without speculative decoding (its two cohorts cost more
    # steps than the overlap saves on the CPUs measured).
    wanted = config.async_scheduling
    if wanted is None:
        wanted = remote and config.speculative_method is None
    async_scheduling = wanted and task == "generate" and info.pipeline_parallel_size <= 1
    return Scheduler(config, num_blocks=info.num_blocks, block_size=info.block_size,
                     vocab_size=info.vocab_size, eos_token_ids=eos,
                     max_model_len=info.max_model_len or None,
                     max_num_seqs=info.max_num_reqs or None, tokenizer=tokenizer, task=task,
                     hidden_size=info.hidden_size,
                     send_new_tokens=info.pipeline_parallel_size > 1,
                     async_scheduling=async_scheduling, max_loras=info.max_loras)
