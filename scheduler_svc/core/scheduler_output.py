"""The SchedulerOutput message of one step, built straight from the scheduler's decision: the
edge where it leaves this process (one pass over the batch), and the short wire ids that keep a
256-request decode step's message under 4 KiB."""

from __future__ import annotations

from batchwire.v1 import worker_pb2

from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Request

_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def short_id(n: int) -> str:
    """Base-36 ids keep a 256-request decode step's SchedulerOutput under 4 KiB."""
    digits = []
    while True:
        n, r = divmod(n, 36)
        digits.append(_BASE36[r])
        if n == 0:
            return "".join(reversed(digits))


def _lora_ref(r: Request) -> worker_pb2.LoRAAdapterRef | None:
    """The adapter as the worker reads it: with its path on every new request, a few dozen
    bytes sent once per request, so a worker that never met the id (a new replica, a worker
    restarted) reads it without another round trip."""
    if r.lora is None:
        return None
    return worker_pb2.LoRAAdapterRef(id=r.lora.lora_int_id, name=r.lora.lora_name,
                                     path=r.lora.lora_path)


def build_scheduler_output(
    step_id: int,
    finished_req_ids: list[str],
    kv: KVCacheManager,
    eos_token_ids: frozenset[int],
    send_new_tokens: bool,
    new_reqs: list[Request],
    running: list[Request],
    resumed: list[Request],
    num_scheduled: dict[str, int],
    new_block_ids: dict[str, list[int]],
) -> worker_pb2.SchedulerOutput:
    so = worker_pb2.SchedulerOutput(
        step_id=step_id,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=finished_req_ids,
    )
    for r in new_reqs:
        so.scheduled_new_reqs.add(
            req_id=r.wire_id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=r.output_token_ids,  # empty unless it moved from a replica
            sampling=r.sampling_params.to_proto(eos_token_ids),
            block_ids=kv.block_ids(r.wire_id),
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=num_scheduled[r.wire_id],
            pooling=r.pooling.to_proto() if r.pooling is not None else None,
            lora=_lora_ref(r),
        )
        r.num_sent_tokens = r.num_tokens
    cached = so.scheduled_cached_reqs
    ids = [r.wire_id for r in running]
    resumed_ids = [r.wire_id for r in resumed]
    cached.req_ids.extend(ids)
    cached.req_ids.extend(resumed_ids)
    cached.resumed_req_ids.extend(resumed_ids)
    # add() then extend() only where there are blocks: ~5x faster than building BlockIds
    # messages, and a steady decode step adds a block to few requests.
    add_block_ids = cached.new_block_ids.add
    for i in ids:
        entry = add_block_ids()
        if new_block_ids[i]:
            entry.ids.extend(new_block_ids[i])
    for i in resumed_ids:
        # A resumed request's blocks are all new to the worker: they replace its table.
        add_block_ids().ids.extend(kv.block_ids(i))
    cached.num_computed_tokens.extend([r.num_computed_tokens for r in running])
    cached.num_computed_tokens.extend([r.num_computed_tokens for r in resumed])
    cached.num_scheduled_tokens.extend([num_scheduled[i] for i in ids])
    cached.num_scheduled_tokens.extend([num_scheduled[i] for i in resumed_ids])
    if send_new_tokens:
        for r in (*running, *resumed):  # parallel to cached.req_ids
            so.cached_new_token_ids.add().ids.extend(r.all_token_ids[r.num_sent_tokens:])
            r.num_sent_tokens = r.num_tokens
    return so
