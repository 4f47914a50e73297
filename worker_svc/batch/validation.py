"""Checks a step's messages against the runner's state before anything is mutated.

A bad SchedulerOutput or GrammarOutput is refused whole, so the persistent batch stays as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np
from batchwire.common import sampling_rules
from batchwire.common.refusals import StepRefused
from batchwire.v1 import worker_pb2


class InvalidStepError(StepRefused):
    """The scheduler sent a step this worker cannot run; nothing was changed. `req_ids`: the
    requests at fault, when the fault is theirs (the scheduler fails only those)."""


class _KnownRequest(Protocol):
    @property
    def num_tokens(self) -> int: ...

    block_ids: list[int]
    sampling: worker_pb2.RequestSamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class StepLimits:
    """What a step may ask of this runner: its vocabulary, KV pool and batch sizes."""

    vocab_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_reqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    samples: bool = True  # False on a pooling (embedding) worker: sampling values go unused


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedStep:
    """What validation learned of a step that the runner's update can reuse (reading a protobuf
    repeated field costs ~0.2 us an element each time)."""

    cached_req_ids: list[str]  # scheduled_cached_reqs.req_ids, read once
    no_new_blocks: bool  # no cached request gained a block (every new_block_ids entry empty)


def validate_scheduler_output(
    so: worker_pb2.SchedulerOutput,
    requests: Mapping[str, _KnownRequest],
    limits: StepLimits,
    appends_new_tokens: bool = False,
) -> CheckedStep:
    """`appends_new_tokens`: this rank learns sampled tokens from cached_new_token_ids (a
    pipeline stage before the last), so a cached request holds that many more tokens."""
    finished = set(so.finished_req_ids)
    drafts = _draft_counts(so.scheduled_spec_decode_tokens, limits.vocab_size)
    seen: set[str] = set()
    total = 0
    for new in so.scheduled_new_reqs:
        with _naming(new.req_id):
            total += _check_new(new, requests, finished, drafts, seen, limits)

    cached = so.scheduled_cached_reqs
    n = len(cached.req_ids)
    for field in ("new_block_ids", "num_computed_tokens", "num_scheduled_tokens"):
        if len(getattr(cached, field)) != n:
            raise InvalidStepError(
                f"scheduled_cached_reqs.{field} has {len(getattr(cached, field))} entries "
                f"for {n} req_ids"
            )
    new_tokens = so.cached_new_token_ids
    if (new_tokens or appends_new_tokens) and len(new_tokens) != n:
        raise InvalidStepError(
            f"cached_new_token_ids has {len(new_tokens)} entries for {n} req_ids"
            + (" (a pipeline stage before the last needs one per request)" * appends_new_tokens)
        )
    req_ids = list(cached.req_ids)
    resumed = set(cached.resumed_req_ids)
    if not resumed <= set(req_ids):
        raise InvalidStepError(
            f"resumed_req_ids {sorted(resumed - set(req_ids))} are not scheduled"
        )
    no_new_blocks = not drafts and not appends_new_tokens and no_block_added(cached)
    if not drafts and not appends_new_tokens and _cached_requests_valid(
        cached, requests, finished, resumed, seen, limits, req_ids, no_new_blocks
    ):
        # NOTE: the common steady decode step, checked in bulk. The loop below stays the
        # reference: it runs whenever the bulk check finds anything amiss, so a refusal and its
        # message are the same either way.
        seen.update(req_ids)
        total += sum(cached.num_scheduled_tokens)
        cached_done = True
    else:
        cached_done = False
    for i, req_id in enumerate(() if cached_done else cached.req_ids):
        where = f"cached request {req_id!r}"
        _check_id(req_id, where, seen)
        state = requests.get(req_id)
        if state is None or req_id in finished:
            raise InvalidStepError(f"{where} is unknown to this worker")
        new_blocks = cached.new_block_ids[i].ids
        _check_blocks(new_blocks, limits, where)
        if new_blocks and req_id not in resumed:
            held = set(state.block_ids).intersection(new_blocks)
            if held:
                raise InvalidStepError(
                    f"{where}: block id {min(held)} is already in its block table"
                )
        num_tokens = state.num_tokens
        if appends_new_tokens and new_tokens:
            _check_tokens(new_tokens[i].ids, limits.vocab_size, where)
            num_tokens += len(new_tokens[i].ids)
        num_drafts = drafts.get(req_id, 0)
        if num_drafts:
            _check_drafts(
                num_drafts, cached.num_computed_tokens[i], cached.num_scheduled_tokens[i],
                num_tokens, state.sampling, limits, where,
            )  # fmt: skip
        _check_counts(
            cached.num_computed_tokens[i], cached.num_scheduled_tokens[i],
            num_tokens + num_drafts, where,
        )  # fmt: skip
        will_sample = (
            cached.num_computed_tokens[i] + cached.num_scheduled_tokens[i]
            == num_tokens + num_drafts
        )
        if will_sample and num_tokens >= limits.max_model_len:
            raise InvalidStepError(
                f"{where} already holds max_model_len={limits.max_model_len} tokens"
            )
        num_blocks = len(new_blocks) + (0 if req_id in resumed else len(state.block_ids))
        needed = cached.num_computed_tokens[i] + cached.num_scheduled_tokens[i]
        _check_coverage(num_blocks, needed, limits, where)
        total += cached.num_scheduled_tokens[i]

    unscheduled = sorted(drafts.keys() - seen)
    if unscheduled:
        raise InvalidStepError(
            f"draft tokens for requests not scheduled this step: {unscheduled[:4]}"
        )
    if total != so.total_num_scheduled_tokens:
        raise InvalidStepError(
            f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens}, "
            f"the requests add up to {total}"
        )
    if total > limits.max_num_batched_tokens:
        raise InvalidStepError(
            f"{total} tokens scheduled, "
            f"above max_num_batched_tokens={limits.max_num_batched_tokens}"
        )
    if len(seen) > limits.max_num_reqs:
        raise InvalidStepError(
            f"{len(seen)} requests scheduled, above max_num_reqs={limits.max_num_reqs}"
        )
    return CheckedStep(req_ids, no_new_blocks)



def _check_new(
    new: worker_pb2.NewRequestData,
    requests: Mapping[str, _KnownRequest],
    finished: set[str],
    drafts: Mapping[str, int],
    seen: set[str],
    limits: StepLimits,
) -> int:
    """One new request's checks; its scheduled tokens."""
    where = f"new request {new.req_id!r}"
    _check_id(new.req_id, where, seen)
    if new.req_id in requests and new.req_id not in finished:
        raise InvalidStepError(f"{where} is already running on this worker")
    n_prompt, n_output = len(new.prompt_token_ids), len(new.output_token_ids)
    if not n_prompt or n_prompt + n_output >= limits.max_model_len:
        raise InvalidStepError(
            f"{where}: prompt length {n_prompt} plus output length {n_output} must be in "
            f"[1, max_model_len={limits.max_model_len}), with a prompt"
        )
    _check_tokens(new.prompt_token_ids, limits.vocab_size, where)
    _check_tokens(new.output_token_ids, limits.vocab_size, where)
    _check_blocks(new.block_ids, limits, where)
    num_drafts = drafts.get(new.req_id, 0)
    if num_drafts:
        _check_drafts(
            num_drafts, new.num_computed_tokens, new.num_scheduled_tokens,
            n_prompt + n_output, new.sampling, limits, where,
        )  # fmt: skip
    _check_counts(
        new.num_computed_tokens,
        new.num_scheduled_tokens,
        n_prompt + n_output + num_drafts,
        where,
    )
    _check_coverage(
        len(new.block_ids), new.num_computed_tokens + new.num_scheduled_tokens, limits, where
    )
    _check_sampling(new.sampling, limits, where)
    _check_shaping(new.sampling, limits.vocab_size, where)
    return new.num_scheduled_tokens


@contextlib.contextmanager
def _naming(req_id: str) -> Iterator[None]:
    """A refusal raised inside names this request as the one at fault."""
    try:
        yield
    except InvalidStepError as e:
        if not e.req_ids:
            e.req_ids = [req_id]
        raise


def no_block_added(cached: worker_pb2.CachedRequestData) -> bool:
    """True when every new_block_ids entry is empty, without reading the entries one by one
    (~1.5 us each): an empty entry serializes as 2 bytes (its tag, a zero length) and any other
    (ids, or unknown fields) as more, so the field's size tells. A steady decode step between
    block boundaries adds no block."""
    n = len(cached.new_block_ids)
    if not n:
        return True
    rest = worker_pb2.CachedRequestData()
    rest.CopyFrom(cached)
    rest.ClearField("new_block_ids")
    return cached.ByteSize() - rest.ByteSize() == 2 * n


def _cached_requests_valid(
    cached: worker_pb2.CachedRequestData,
    requests: Mapping[str, _KnownRequest],
    finished: set[str],
    resumed: set[str],
    seen: set[str],
    limits: StepLimits,
    req_ids: list[str] | None = None,
    no_new_blocks: bool = False,
) -> bool:
    """True when every cached request passes the per-request checks of the loop in
    validate_scheduler_output (no drafts, no appended tokens), computed over whole arrays.
    req_ids: cached.req_ids as a list, when the caller has it; no_new_blocks: what
    no_block_added(cached) said (False: the entries are read)."""
    if req_ids is None:
        req_ids = list(cached.req_ids)
    ids = set(req_ids)
    n = len(req_ids)
    if len(ids) != n or "" in ids or not ids.isdisjoint(seen) or not ids.isdisjoint(finished):
        return False
    if not requests.keys() >= ids:
        return False
    if not n:
        return True
    states = [requests[r] for r in req_ids]
    num_tokens = np.fromiter((s.num_tokens for s in states), np.int64, n)  # [reqs]
    held_blocks = np.fromiter((len(s.block_ids) for s in states), np.int64, n)  # [reqs]
    if no_new_blocks:
        num_new_blocks = np.zeros(n, np.int64)  # [reqs]
    else:
        new_blocks = list(cached.new_block_ids)
        num_new_blocks = np.fromiter((len(b.ids) for b in new_blocks), np.int64, n)  # [reqs]
    if num_new_blocks.any():
        added = [x for b in new_blocks for x in b.ids]
        if not (0 < min(added) and max(added) < limits.num_blocks):
            return False
        for i in np.flatnonzero(num_new_blocks):  # a block appears once in a request's table
            ids = new_blocks[i].ids
            table = () if req_ids[i] in resumed else states[i].block_ids
            if len(set(ids)) != len(ids) or not set(table).isdisjoint(ids):
                return False
    computed = np.fromiter(cached.num_computed_tokens, np.int64, n)  # [reqs]
    scheduled = np.fromiter(cached.num_scheduled_tokens, np.int64, n)  # [reqs]
    needed = computed + scheduled
    if computed.min() < 0 or scheduled.min() < 0 or (needed > num_tokens).any():
        return False
    if ((needed == num_tokens) & (num_tokens >= limits.max_model_len)).any():
        return False  # it would sample past max_model_len
    if resumed:
        held_blocks[[r in resumed for r in req_ids]] = 0
    num_blocks = held_blocks + num_new_blocks
    max_blocks = -(-limits.max_model_len // limits.block_size)
    return not ((num_blocks * limits.block_size < needed) | (num_blocks > max_blocks)).any()


def validate_grammar_output(
    g: worker_pb2.GrammarOutput,
    batch_req_ids: Mapping[str, int],
    vocab_size: int,
    drafted: Collection[str] = (),
) -> None:
    words = -(-vocab_size // 32)
    expected = len(g.req_ids) * words * 4
    if len(g.bitmask) != expected:
        raise InvalidStepError(
            f"grammar bitmask has {len(g.bitmask)} bytes; {len(g.req_ids)} rows of {words} int32 "
            f"words need {expected}"
        )
    unknown = [r for r in g.req_ids if r not in batch_req_ids]
    if unknown:
        raise InvalidStepError(f"grammar bitmask names requests not in this step: {unknown[:4]}")
    if len(set(g.req_ids)) != len(g.req_ids):
        # Both rows would mask the same logits: two rows that each allow some token can
        # together allow none, which silently sampled token 0.
        twice = next(r for i, r in enumerate(g.req_ids) if r in g.req_ids[:i])
        raise InvalidStepError(
            f"grammar bitmask names request {twice!r} twice (one row each)", [twice]
        )
    rows = np.frombuffer(g.bitmask, dtype="<i4").reshape(len(g.req_ids), words)  # [reqs, words]
    full, rest = divmod(vocab_size, 32)
    allows = rows[:, :full].any(axis=1)  # [reqs]; a word's bits are 32 tokens
    if rest:  # the last word's bits past the vocabulary do not count
        allows |= (rows[:, full] & ((1 << rest) - 1)) != 0
    empty = np.flatnonzero(~allows)
    if empty.size:
        # Sampling from a row with no allowed token would silently pick token 0.
        raise InvalidStepError(
            f"grammar bitmask row of {g.req_ids[empty[0]]!r} allows no token of the vocabulary",
            [g.req_ids[i] for i in empty],
        )
    # One mask row per request fits only its first position; drafted requests are unconstrained.
    constrained_drafts = [r for r in g.req_ids if r in drafted]
    if constrained_drafts:
        raise InvalidStepError(
            f"grammar bitmask names requests with draft tokens: {constrained_drafts[:4]}",
            constrained_drafts,
        )


def _draft_counts(
    entries: Sequence[worker_pb2.SpecDecodeTokens], vocab_size: int
) -> dict[str, int]:
    """req_id -> number of drafts, after checking each entry on its own."""
    counts: dict[str, int] = {}
    for entry in entries:
        where = f"draft tokens of {entry.req_id!r}"
        if entry.req_id in counts:
            raise InvalidStepError(f"{where} are listed twice in scheduled_spec_decode_tokens")
        if not entry.ids:
            raise InvalidStepError(f"{where}: an entry with no ids (leave the request out)")
        _check_tokens(entry.ids, vocab_size, where)
        counts[entry.req_id] = len(entry.ids)
    return counts


def _check_drafts(
    num_drafts: int,
    computed: int,
    scheduled: int,
    num_tokens: int,
    sampling: worker_pb2.RequestSamplingParams,
    limits: StepLimits,
    where: str,
) -> None:
    """A request verifying d drafts is decoding and runs its last token plus the d drafts."""
    if computed != num_tokens - 1:
        raise InvalidStepError(
            f"{where}: {num_drafts} draft tokens for a request mid-prefill ({computed} of "
            f"{num_tokens} tokens computed; drafts need all but the last)"
        )
    if scheduled != 1 + num_drafts:
        raise InvalidStepError(
            f"{where}: {num_drafts} draft tokens need exactly {1 + num_drafts} scheduled tokens, "
            f"got {scheduled}"
        )
    constraint = sampling.WhichOneof("constraint")
    if constraint is not None:
        raise InvalidStepError(
            f"{where}: draft tokens for a request with a {constraint} constraint, which "
            "speculative decoding does not support"
        )
    if num_tokens + num_drafts >= limits.max_model_len:
        raise InvalidStepError(
            f"{where}: {num_tokens} tokens and {num_drafts} drafts reach "
            f"max_model_len={limits.max_model_len}"
        )


def _check_id(req_id: str, where: str, seen: set[str]) -> None:
    if not req_id:
        raise InvalidStepError(f"{where}: empty req_id")
    if req_id in seen:
        raise InvalidStepError(f"{where} is scheduled twice in one step")
    seen.add(req_id)


def _check_tokens(token_ids: Sequence[int], vocab_size: int, where: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidStepError(
            f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        )


def _check_shaping(
    sampling: worker_pb2.RequestSamplingParams, vocab_size: int, where: str
) -> None:
    """Logit shaping indexes the logits by these ids: one outside the vocabulary is refused."""
    _check_tokens(list(sampling.logit_bias), vocab_size, f"{where} logit_bias")
    _check_tokens(sampling.allowed_token_ids, vocab_size, f"{where} allowed_token_ids")
    for word in sampling.bad_words:
        if not word.ids:
            raise InvalidStepError(f"{where} bad_words: an empty token sequence")
        _check_tokens(word.ids, vocab_size, f"{where} bad_words")


def _check_blocks(block_ids: Sequence[int], limits: StepLimits, where: str) -> None:
    # Block 0 is the scheduler's reserved null block and never holds a request's tokens.
    bad = [b for b in block_ids if not 0 < b < limits.num_blocks]
    if bad:
        raise InvalidStepError(
            f"{where}: block id {bad[0]} outside the pool [1, {limits.num_blocks})"
        )
    if len(set(block_ids)) != len(block_ids):
        twice = next(b for i, b in enumerate(block_ids) if b in block_ids[:i])
        raise InvalidStepError(f"{where}: block id {twice} is listed twice in its block table")


def _check_sampling(
    sampling: worker_pb2.RequestSamplingParams, limits: StepLimits, where: str
) -> None:
    """The worker is a service of its own: it takes no sampling value the scheduler would have
    refused on trust. The rules are the scheduler's admission's (common/sampling_rules.py)."""
    p = sampling
    try:
        sampling_rules.check_logprobs(
            "logprobs", p.logprobs if p.HasField("logprobs") else None, limits.max_logprobs
        )
        sampling_rules.check_logprobs(
            "prompt_logprobs",
            p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
            limits.max_logprobs,
        )
        if limits.samples:  # a pooling worker samples nothing: the values go unused
            sampling_rules.check_values(p)
            sampling_rules.check_vocabulary(p, limits.vocab_size)
    except sampling_rules.SamplingRuleError as e:
        raise InvalidStepError(f"{where}: sampling.{e.field}={e}") from None


def _check_counts(computed: int, scheduled: int, num_tokens: int, where: str) -> None:
    if computed < 0 or scheduled < 0:
        raise InvalidStepError(
            f"{where}: negative token count (computed {computed}, scheduled {scheduled})"
        )
    if computed + scheduled > num_tokens:
        raise InvalidStepError(
            f"{where}: {computed} computed + {scheduled} scheduled tokens exceed the "
            f"request's {num_tokens} tokens"
        )


def _check_coverage(num_blocks: int, num_tokens: int, limits: StepLimits, where: str) -> None:
    if num_blocks * limits.block_size < num_tokens:
        raise InvalidStepError(
            f"{where}: {num_blocks} blocks of {limits.block_size} cannot hold {num_tokens} tokens"
        )
    if num_blocks > -(-limits.max_model_len // limits.block_size):
        raise InvalidStepError(
            f"{where}: {num_blocks} blocks exceed max_model_len={limits.max_model_len}"
        )
