"""A worker's refusal of a step, per request: the refused requests fail, the step goes again
without them, and every other request carries on as if nothing happened.

The worker checks a whole step before it changes anything (worker_svc/batch/validation.py), so
after a refusal it holds exactly what it held before the step. The scheduler, though, has already
planned the step: it allocated blocks, made them findable in the prefix cache, and counted the
scheduled tokens as computed. So the refused requests end here (their blocks freed and their step's
blocks forgotten by the prefix cache: nothing was ever written there), and the same step, less
them, is what the worker gets next: for everyone else it is the step the scheduler planned.

A new request of the step that found a refused one's blocks in the prefix cache (the same prompt
prefix, admitted in the same step) would read KV that is now never written: it goes back to the
queue, unscheduled, to be sent again as new.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from batchwire.v1 import worker_pb2

from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


def refused_in_step(so: worker_pb2.SchedulerOutput, named: Collection[str]) -> list[str]:
    """The step's requests a refusal is about: those it names, or, naming none, the step's new
    requests (what the worker has not accepted yet). Empty: the step itself is at fault."""
    new = [r.req_id for r in so.scheduled_new_reqs]
    if not named:
        return new
    in_step = set(new) | set(so.scheduled_cached_reqs.req_ids)
    return [r for r in named if r in in_step]


def drop_refused(scheduler: Scheduler, so: worker_pb2.SchedulerOutput, refused: list[str],
                 reason: str) -> tuple[worker_pb2.SchedulerOutput, list[EngineCoreOutput]]:
    """Ends the refused requests (wire ids of step `so`) with `reason`; returns the step to send
    instead and the refused requests' last outputs (finish_reason "abort", `error` set)."""
    gone = set(refused)
    requests = [scheduler.requests[r] for r in refused if r in scheduler.requests]
    scheduled = _scheduled_tokens(so)
    unwritten: set[int] = set()  # blocks the refused requests were to write in this step
    for request in requests:
        first = _first_unwritten_block(scheduler, request, scheduled)
        blocks = scheduler.kv.req_to_blocks.get(request.wire_id, [])
        unwritten.update(b.block_id for b in blocks[first:])
        scheduler.kv.forget_cached(request, first)
    # New requests of this step that found those blocks in the prefix cache go back to wait.
    requeued = [r.req_id for r in so.scheduled_new_reqs if r.req_id not in gone
                and unwritten.intersection(r.block_ids)]
    new = {r.req_id for r in so.scheduled_new_reqs}
    outputs = fail_refused(scheduler, [r for r in refused if r not in new], reason)
    # The worker never took the new ones on: it hears nothing of their end.
    outputs += fail_refused(scheduler, [r for r in refused if r in new], reason, told=False)
    for req_id in requeued:
        request = scheduler.requests[req_id]
        scheduler.kv.forget_cached(request, _first_unwritten_block(scheduler, request, scheduled))
        _requeue_unsent(scheduler, request)
    logger.info("the worker refused %d request(s) of step %d (%s); the step goes again "
                   "without them%s", len(requests), so.step_id, reason,
                   f", {len(requeued)} sharing their blocks wait again" if requeued else "")
    return _without(so, gone | set(requeued), scheduled), outputs


def fail_refused(scheduler: Scheduler, refused: list[str], reason: str,
                 told: bool = True) -> list[EngineCoreOutput]:
    """Ends the refused requests (wire ids) with `reason`: their last outputs (finish_reason
    "abort", `error` set), counted in the stats. `told`: the worker holds them and hears of
    their end in the next step (False: it never took them on)."""
    outputs = []
    for req_id in refused:
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        for out in scheduler.abort_requests([request]):
            out.error = reason
            outputs.append(out)
        if not told:
            scheduler.finished_req_ids.remove(req_id)
        scheduler.stats.num_refused_requests += 1
        logger.warning("the worker refused request %s (%s): it fails alone", request.request_id,
                       reason)
    return outputs


def _first_unwritten_block(scheduler: Scheduler, request: Request,
                           scheduled: dict[str, int]) -> int:
    """The first of the request's blocks that the step was to write (schedule() already counted
    the step's tokens as computed)."""
    before = request.num_computed_tokens - scheduled.get(request.wire_id, 0)
    return before // scheduler.kv.block_size


def _requeue_unsent(scheduler: Scheduler, request: Request) -> None:
    """A new request taken out of its first step: back to the queue's front, as never scheduled
    (the worker has not seen it, so it is sent as new again)."""
    scheduler.kv.free(request)
    scheduler.running.remove(request)
    request.num_computed_tokens = 0
    request.num_output_placeholders = 0
    request.status = RequestStatus.WAITING
    scheduler.waiting.prepend(request)


def _scheduled_tokens(so: worker_pb2.SchedulerOutput) -> dict[str, int]:
    counts = {r.req_id: r.num_scheduled_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    counts.update(zip(cached.req_ids, cached.num_scheduled_tokens, strict=True))
    return counts


def _without(so: worker_pb2.SchedulerOutput, gone: set[str],
             scheduled: dict[str, int]) -> worker_pb2.SchedulerOutput:
    """Step `so` less the requests `gone`: their entries, their tokens in the total."""
    out = worker_pb2.SchedulerOutput()
    out.CopyFrom(so)
    del out.scheduled_new_reqs[:]
    out.scheduled_new_reqs.extend(r for r in so.scheduled_new_reqs if r.req_id not in gone)
    cached, kept = so.scheduled_cached_reqs, out.scheduled_cached_reqs
    keep = [i for i, r in enumerate(cached.req_ids) if r not in gone]
    kept.Clear()
    kept.req_ids.extend(cached.req_ids[i] for i in keep)
    kept.num_computed_tokens.extend(cached.num_computed_tokens[i] for i in keep)
    kept.num_scheduled_tokens.extend(cached.num_scheduled_tokens[i] for i in keep)
    for i in keep:
        kept.new_block_ids.add().CopyFrom(cached.new_block_ids[i])
    kept.resumed_req_ids.extend(r for r in cached.resumed_req_ids if r not in gone)
    if so.cached_new_token_ids:
        del out.cached_new_token_ids[:]
        for i in keep:
            out.cached_new_token_ids.add().CopyFrom(so.cached_new_token_ids[i])
    del out.scheduled_spec_decode_tokens[:]
    out.scheduled_spec_decode_tokens.extend(
        e for e in so.scheduled_spec_decode_tokens if e.req_id not in gone)
    out.total_num_scheduled_tokens = so.total_num_scheduled_tokens - sum(
        n for r, n in scheduled.items() if r in gone)
    return out
