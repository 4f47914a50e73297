"""Continuous batching: each step, decide which requests compute how many tokens.

There are no prefill and decode phases. Every request has a token count and a computed count, and
a step gives each request tokens so that the second catches up with the first, within a token
budget and a cap on running requests: running requests first, in order, then waiting ones. A long
prompt is cut into chunks; when the KV pool runs dry a running request is preempted and later
recomputed from scratch.

schedule() builds the protobuf SchedulerOutput directly (scheduler_output.py): it is the edge
where the decision leaves this process, and building it there saves a second pass over the batch
(measured in benchmarks/engine/scheduler_step.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from batchwire.v1 import worker_pb2

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.bad_words import bad_words_token_ids
from scheduler_svc.core.errors import InvalidRequestError, QueueFullError
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.outputs import EngineCoreOutput, TokenLogprobs
from scheduler_svc.core.pooling import PoolingParams, pooled_vectors
from scheduler_svc.core.prompt_logprobs import collect_prompt_logprobs
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import make_queue
from scheduler_svc.core.sampling_params import (
    SamplingParams,
    truncate_prompt,
    validate_length,
    validate_prompt,
)
from scheduler_svc.core.scheduler_output import build_scheduler_output, short_id
from scheduler_svc.core.scheduler_stats import SchedulerStats
from scheduler_svc.core.spec_decode import SpecDecoder, add_drafts, draft_counts, read_logprobs
from scheduler_svc.core.stop_checker import append_tokens, check_stop
from scheduler_svc.core.structured_output import RequestGrammar, build_grammar_output, compiler_for


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        tokenizer: Any = None,
        task: str = "generate",
        hidden_size: int = 0,
        send_new_tokens: bool = False,
        async_scheduling: bool = False,
        max_loras: int = 0,
    ) -> None:
        self.config = config
        self.max_loras = max_loras  # the workers' adapter slots: most adapters in one step
        self.limits = config.request_limits  # read on every add_request
        # Each step is scheduled before the one before it has come back (EngineCore): a request
        # that samples in a step counts one placeholder token until its output arrives.
        self.async_scheduling = async_scheduling
        self.task = task  # "generate" or "embed": the workers serve one
        self.hidden_size = hidden_size  # the longest embedding a request may ask for
        # Pipeline stages before the last sample nothing: each step tells them the tokens sampled.
        self.send_new_tokens = send_new_tokens
        # The worker's own limits may be tighter than ours.
        self.max_model_len = min(config.max_model_len, max_model_len or config.max_model_len)
        self.max_num_seqs = min(config.max_num_seqs, max_num_seqs or config.max_num_seqs)
        self.max_num_batched_tokens = min(
            config.max_num_batched_tokens, max_num_batched_tokens or config.max_num_batched_tokens)
        capacity = (num_blocks - 1) * block_size
        if capacity < self.max_model_len:
            # Otherwise one long request could fill the pool alone and preempt itself forever.
            raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks - 1} blocks of "
                             f"{block_size}), less than max_model_len ({self.max_model_len}): "
                             "give the worker more KV-cache memory or lower max_model_len")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []  # in admission order: FCFS preempts from the end
        # Unfinished requests by wire id: the worker's replies name them so. The client's id is
        # the engine's business (EngineCore.requests), not the scheduler's.
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: list[str] = []  # to tell the worker in the next step
        self._constrained: dict[str, Request] = {}  # unfinished requests with a grammar
        self._next_id = 0
        self.stats = SchedulerStats()
        self.spec = None if config.speculative_method is None else SpecDecoder(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
            self.max_model_len)


    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        grammar: RequestGrammar | None = None,
        output_token_ids: Sequence[int] = (),
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> Request:
        """Validates and queues a request; raises InvalidRequestError or QueueFullError.

        A request moved from another replica brings what it has done there: `output_token_ids`
        (recomputed after the prompt; they count towards max_tokens and the penalties) and its
        `grammar` matcher, already past that output. Its text is not the scheduler's: the
        caller's output processor keeps it (core/output_processor.py)."""
        prompt_token_ids = truncate_prompt(prompt_token_ids, sampling_params, self.max_model_len)
        validate_prompt([*prompt_token_ids, *output_token_ids] if output_token_ids
                        else prompt_token_ids, self.vocab_size, self.max_model_len)
        sampling_params.validate_for(self.vocab_size, self.limits)
        if pooling is None:  # an embedding request generates nothing: only its input must fit
            validate_length(len(prompt_token_ids), sampling_params.max_tokens, self.max_model_len)
        if sampling_params.n != 1:
            raise InvalidRequestError("n", f"{sampling_params.n}: a scheduler runs one sequence "
                                           "per request; fan n out with parallel_sampling")
        sampling_params.bad_words_token_ids = bad_words_token_ids(self.tokenizer,
                                                                  sampling_params.bad_words)
        if (pooling is not None) != (self.task == "embed"):
            raise InvalidRequestError("task", f"this engine serves {self.task!r}: "
                                      + ("embed requests need pooling params" if pooling is None
                                         else "it computes no embeddings"))
        if pooling is not None:
            pooling.validate_for(self.hidden_size)
        if lora is not None and not self.max_loras:
            raise InvalidRequestError("lora", f"adapter {lora.lora_name!r}: this engine's workers "
                                      "serve no LoRA adapters (start them with --max-loras)")
        if sampling_params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer, this engine has none")
        if sampling_params.constraint is not None and grammar is None:
            grammar = self._new_grammar(sampling_params)
        if len(self.waiting) >= self.config.max_queued_requests:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting, the limit is "
                                 f"{self.config.max_queued_requests}")
        wire_id = short_id(self._next_id)
        self._next_id += 1
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        request = Request(wire_id, list(prompt_token_ids), sampling_params, self.eos_token_ids,
                          request_id, arrival, priority, cache_salt, self.max_model_len, lora)
        request.all_token_ids.extend(output_token_ids)
        request.pooling = pooling
        self.requests[wire_id] = request
        if grammar is not None:
            request.grammar = grammar
            self._constrained[wire_id] = request
        self.waiting.add(request)
        return request

    def abort_requests(self, requests: Iterable[Request]) -> list[EngineCoreOutput]:
        """Frees the requests' blocks now; the worker hears of them in the next step. Requests
        that already finished are skipped."""
        return [self._end(r, RequestStatus.FINISHED_ABORTED) for r in requests
                if self.requests.get(r.wire_id) is r]

    def stop_requests(self, stops: Iterable[tuple[Request, int, str]]
                      ) -> list[EngineCoreOutput]:
        """Ends requests that a stop string ended in the output processor, as update_from_output
        once ended them: (request, the output tokens its client got, the stop string). The
        tokens sampled after those are dropped and the blocks freed; requests that already
        finished are skipped. The outputs (no tokens) confirm the end to the caller."""
        outputs = []
        for request, num_output_tokens, stop in stops:
            if self.requests.get(request.wire_id) is not request:
                continue  # a token rule ended it first, or it was aborted
            del request.all_token_ids[request.num_prompt_tokens + num_output_tokens:]
            request.stop_reason = stop
            outputs.append(self._end(request, RequestStatus.FINISHED_STOPPED))
        return outputs

    def _end(self, request: Request, status: RequestStatus) -> EngineCoreOutput:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return self._output(request, [], "", None)

    def has_requests(self) -> bool:
        """Work left: unfinished requests, or finished ids the worker has not heard of yet."""
        return bool(self.requests) or bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)


    def schedule(self) -> worker_pb2.SchedulerOutput:
        threshold = (self.config.long_prefill_token_threshold
                     if self.config.enable_chunked_prefill else 0)
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}  # wire id -> tokens to compute this step
        new_block_ids: dict[str, list[int]] = {}  # running requests' blocks added this step
        scheduled_running: list[Request] = []
        drafts: dict[str, np.ndarray] = {}  # wire id -> [d] draft tokens, d >= 1
        preempted = False

        i = 0
        running = self.running
        cohort = self._cohort() if self.spec is not None and self.async_scheduling else None
        while i < len(running) and budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if cohort is not None and request not in cohort:
                i += 1  # in flight (its drafts need its tokens), or it joins the next step
                continue
            if placeholders and len(request.all_token_ids) + placeholders >= request.max_num_tokens:
                i += 1  # the tokens in flight reach its length limit: it stops there
                continue
            n = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            new_blocks = None
            if self.spec is not None and n == 1:
                new_blocks, proposed = self.spec.allocate_with_drafts(self.kv, request, budget)
                if new_blocks is not None:
                    n += proposed.size
                    drafts[request.wire_id] = proposed
            if new_blocks is None:
                new_blocks = self.kv.allocate_slots(request, n)
            while new_blocks is None:
                victim = self._preemption_victim()
                index = self.running.index(victim)
                del self.running[index]
                if victim.wire_id in num_scheduled:  # possible under the priority policy
                    budget += num_scheduled.pop(victim.wire_id)
                    del new_block_ids[victim.wire_id]
                    drafts.pop(victim.wire_id, None)
                    scheduled_running.remove(victim)
                if index < i:
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, n)
            if new_blocks is None:
                break  # the request preempted itself: nothing else can fit either
            scheduled_running.append(request)
            num_scheduled[request.wire_id] = n
            new_block_ids[request.wire_id] = [b.block_id for b in new_blocks]
            budget -= n
            i += 1

        # A step that preempted is short of blocks: admitting now would hand the blocks just
        # freed to a newcomer, and the next step would preempt again (thrashing).
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        # A step may mix at most max_loras adapters (the workers' slots): a request of another
        # adapter waits for a running one's adapter to leave.
        loras = {r.lora.lora_int_id for r in self.running if r.lora} if self.max_loras else set()
        while (not preempted and len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek()
            lora_id = request.lora.lora_int_id if request.lora is not None else 0
            if lora_id and lora_id not in loras:
                if len(loras) >= self.max_loras:
                    break
                loras.add(lora_id)
            hits, num_hit = self.kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if not self.config.enable_chunked_prefill and n > budget:
                break  # it must run whole; those behind it wait their turn (FCFS)
            n = min(n, budget)
            if self.kv.allocate_slots(request, n, hits, num_hit) is None:
                break
            self.waiting.pop()
            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                new_reqs.append(request)
                request.num_cached_tokens = num_hit
            else:
                resumed_reqs.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.stats.num_prefix_queries += request.num_tokens
            self.stats.num_prefix_hits += num_hit
            num_scheduled[request.wire_id] = n
            budget -= n

        so = build_scheduler_output(
            self.stats.num_steps, self.finished_req_ids, self.kv, self.eos_token_ids,
            self.send_new_tokens, new_reqs, scheduled_running, resumed_reqs, num_scheduled,
            new_block_ids)
        add_drafts(so, drafts)
        # The KV of the scheduled tokens is being written now: the next step starts after it.
        for request in (*scheduled_running, *new_reqs, *resumed_reqs):
            request.num_computed_tokens += num_scheduled[request.wire_id]
            if self.async_scheduling and request.num_computed_tokens >= (
                    len(request.all_token_ids) + request.num_output_placeholders):
                request.num_output_placeholders += 1  # it samples in this step
        self.finished_req_ids = []
        self.stats.num_steps += 1
        return so

    def _cohort(self) -> set[Request]:
        """Async scheduling with speculative decoding: the running requests this step may take.

        A step with drafts keeps 1 to d + 1 tokens, so a request's next drafts (and its computed
        count) are known only once its step has come back: a request with a step in flight is
        not scheduled, and the one it next gets is planned from known tokens as without async
        scheduling. The overlap comes from two cohorts taking turns, one computed by the worker
        while the other's output is applied and its next step scheduled; when more requests are
        ready than in flight, this step takes only half of the running ones (in the policy's
        order) and the rest join the other cohort, so that the two stay the same size."""
        ready = [r for r in self.running if not r.num_output_placeholders]
        take = (len(self.running) + 1) // 2
        if len(ready) <= take:
            return set(ready)
        if self.config.policy == "priority":
            ready.sort(key=lambda r: (r.priority, r.arrival_time))
        return set(ready[:take])

    def get_grammar_bitmask(self, so: worker_pb2.SchedulerOutput
                            ) -> worker_pb2.GrammarOutput | None:
        """One bitmask row per constrained request that samples in step `so` (rows still
        mid-prefill sample nothing); None when there is none. Built while the forward pass runs."""
        if not self._constrained:
            return None
        req_ids: list[str] = []
        grammars: list[RequestGrammar] = []
        for req_id in (*(r.req_id for r in so.scheduled_new_reqs),
                       *so.scheduled_cached_reqs.req_ids):
            request = self._constrained.get(req_id)
            # num_computed_tokens already counts this step's tokens (schedule() advanced it).
            if (request is not None and request.grammar is not None
                    and request.num_computed_tokens >= request.num_tokens):
                req_ids.append(req_id)
                grammars.append(request.grammar)
        if not req_ids:
            return None
        return build_grammar_output(req_ids, grammars, self.vocab_size)

    def update_from_output(
        self, so: worker_pb2.SchedulerOutput, model_output: worker_pb2.ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends the sampled tokens of step `so`, applies the token stop rules, frees finished
        requests' blocks; returns what each request gained (token ids: the caller's output
        processor adds the text and checks stop strings)."""
        if model_output.pooler_output:
            return self._update_from_pooled(model_output)
        outputs = []
        stopped: set[Request] = set()
        drafted = draft_counts(so) if so.scheduled_spec_decode_tokens else None
        requests = self.requests
        prompt_logprobs = model_output.prompt_logprobs
        logprobs_sent = bool(model_output.logprobs) or bool(prompt_logprobs)
        max_model_len = self.max_model_len
        for index, (req_id, sampled) in enumerate(
                zip(model_output.req_ids, model_output.sampled_token_ids, strict=True)):
            if prompt_logprobs and prompt_logprobs[index].positions:
                collect_prompt_logprobs(requests.get(req_id), prompt_logprobs[index])
            new_ids = sampled.ids[:]  # a list; 2x faster than list() on a repeated field
            if not new_ids:
                continue  # still mid-prefill
            request = requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran, or stopped by the step before (async)
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if (drafted is None and not logprobs_sent and len(new_ids) == 1
                    and request.grammar is None and request.prompt_logprobs is None):
                # NOTE: the steady decode step, one token per request, inlined: the general
                # path below costs ~2x per request (measured with bench overhead).
                token = new_ids[0]
                all_ids = request.all_token_ids
                all_ids.append(token)
                if token in request.stop_ids or len(all_ids) >= request.max_num_tokens:
                    status = check_stop(request, max_model_len)
                    if status is not None:
                        self._stop(request, status, stopped)
                        outputs.append(self._output(request, new_ids, "", None))
                        continue
                outputs.append(EngineCoreOutput(
                    request.request_id, new_ids, "", False, None, None,
                    request.num_prompt_tokens, len(all_ids) - request.num_prompt_tokens, None,
                    request.num_cached_tokens))
                continue
            if drafted is not None and (num_drafts := drafted.get(req_id, 0)):
                # The worker kept len(new_ids) of the 1 + d positions; the KV of the rest is
                # stale, recomputed from the first rejected position on (a request preempted
                # while the step was in flight, async, recomputes everything anyway).
                if request.status != RequestStatus.PREEMPTED:
                    request.num_computed_tokens -= num_drafts + 1 - len(new_ids)
                self.stats.record_verified(num_drafts, len(new_ids) - 1)
            status = append_tokens(request, new_ids, self.max_model_len)
            logprobs = read_logprobs(model_output, index, drafted is not None, len(new_ids))
            if status is not None:
                self._stop(request, status, stopped)
            outputs.append(self._output(request, new_ids, "", logprobs))
            if request.prompt_logprobs is not None:
                outputs[-1].prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if stopped:
            self.running = [r for r in self.running if r not in stopped]
        return outputs


    def _update_from_pooled(self, model_output: worker_pb2.ModelRunnerOutput
                            ) -> list[EngineCoreOutput]:
        """A pooling step: each request whose vector came finishes now and frees its blocks."""
        outputs = []
        pooled: set[Request] = set()
        for req_id, vector in pooled_vectors(model_output):
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            pooled.add(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            out = self._output(request, [], "", None)
            out.embedding = vector
            outputs.append(out)
        if pooled:
            self.running = [r for r in self.running if r not in pooled]
        return outputs

    def _stop(self, request: Request, status: RequestStatus, stopped: set[Request]) -> None:
        """Ends a request on its output. With async scheduling it may have been preempted since
        that step was sent: it then waits in the queue, not among the running."""
        if request.status == RequestStatus.PREEMPTED:
            self.waiting.remove(request)
        else:
            stopped.add(request)
        self._finish(request, status)

    def _preemption_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

    def _preempt(self, request: Request) -> None:
        """Recompute, not swap: the blocks go back to the pool, the request to the queue's front."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.prompt_logprobs:
            request.prompt_logprobs = []  # its prompt is computed again, from the start
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        # The worker knows a request once it has been scheduled; only then must it be told.
        if request.status != RequestStatus.WAITING:
            self.finished_req_ids.append(request.wire_id)
        request.status = status
        self.kv.free(request)
        if self.spec is not None:
            self.spec.forget(request)
        del self.requests[request.wire_id]
        self._constrained.pop(request.wire_id, None)

    def _new_grammar(self, params: SamplingParams) -> RequestGrammar:
        assert params.constraint is not None
        if self.tokenizer is None:
            raise InvalidRequestError(params.constraint.kind, "structured output needs a "
                                                              "tokenizer, this engine has none")
        # A cache hit when the request came through an admission path that compiled it already.
        compiled = compiler_for(self.tokenizer, self.vocab_size).compile(params.constraint)
        return RequestGrammar(compiled, self.eos_token_ids)

    def _output(self, request: Request, new_ids: list[int], text: str,
                logprobs: list[TokenLogprobs] | None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id, new_ids, text, request.is_finished, request.status.finish_reason,
            request.stop_reason, request.num_prompt_tokens, request.num_output_tokens, logprobs,
            request.num_cached_tokens)
