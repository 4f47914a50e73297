"""Hostile worker messages: a valid next step broken in one way that the worker must refuse,
grammar outputs it must refuse, and messages built from scratch with wild values."""

from __future__ import annotations

import math
from collections.abc import Callable

from batchwire.v1 import worker_pb2 as pb
from hypothesis import strategies as st

from .scheduler_model import ID_PREFIX, SchedulerModel, StepPlan

INT32 = st.integers(-(2**31), 2**31 - 1)
WILD_FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 3.4e38, -1e-45]),
                        st.floats(width=32))
# Strings a careless or hostile scheduler might send as ids: unicode junk, controls, long ones.
JUNK_TEXT = st.one_of(st.text(max_size=12), st.text(st.characters(codec="utf-8"), max_size=40),
                      st.just("x" * 5000), st.just("\x00"), st.just("\u202e\ufeff"))

Mutation = Callable[[pb.SchedulerOutput, SchedulerModel, object], bool]


def _cached(so: pb.SchedulerOutput) -> pb.CachedRequestData:
    return so.scheduled_cached_reqs


def _set_total(so: pb.SchedulerOutput, total: int) -> None:
    so.total_num_scheduled_tokens = max(-(2**31), min(2**31 - 1, total))  # an int32 field


def wrong_total(so, model, draw) -> bool:
    t = so.total_num_scheduled_tokens
    _set_total(so, t + draw(st.sampled_from([1, -1, 2**31 - 1 - t, -(2**31) - t])))
    return True


def unknown_cached(so, model, draw) -> bool:
    if not _cached(so).req_ids:
        return False
    i = draw(st.integers(0, len(_cached(so).req_ids) - 1))
    _cached(so).req_ids[i] = draw(st.sampled_from(["", "nobody", ID_PREFIX + "999999"]))
    return True


def cached_twice(so, model, draw) -> bool:
    c = _cached(so)
    if not c.req_ids:
        return False
    c.req_ids.append(c.req_ids[0])
    c.new_block_ids.add()
    c.num_computed_tokens.append(c.num_computed_tokens[0])
    c.num_scheduled_tokens.append(0)
    return True


def new_already_running(so, model, draw) -> bool:
    held = [r for r in model.requests if r not in so.finished_req_ids]
    if not held:
        return False
    so.scheduled_new_reqs.add(req_id=draw(st.sampled_from(sorted(held))), prompt_token_ids=[1],
                              block_ids=[model.garbage_blocks[0]], num_scheduled_tokens=1)
    so.total_num_scheduled_tokens += 1
    return True


def new_twice(so, model, draw) -> bool:
    if not so.scheduled_new_reqs:
        return False
    so.scheduled_new_reqs.append(so.scheduled_new_reqs[0])
    so.total_num_scheduled_tokens += so.scheduled_new_reqs[0].num_scheduled_tokens
    return True


def empty_new_id(so, model, draw) -> bool:
    if not so.scheduled_new_reqs:
        return False
    so.scheduled_new_reqs[0].req_id = ""
    return True


def _replace_one(targets: list, bad: int, draw) -> bool:
    """Puts `bad` in place of one entry of one of the (non-empty) lists."""
    if not targets:
        return False
    target = draw(st.sampled_from(targets))
    target[draw(st.integers(0, len(target) - 1))] = bad
    return True


def _block_lists(so: pb.SchedulerOutput) -> list:
    lists = [new.block_ids for new in so.scheduled_new_reqs if new.block_ids]
    return lists + [b.ids for b in _cached(so).new_block_ids if b.ids]


def bad_token(so, model, draw) -> bool:
    bad = draw(st.one_of(st.integers(model.vocab_size, 2**31 - 1), st.integers(-(2**31), -1)))
    targets = [list_ for new in so.scheduled_new_reqs
               for list_ in (new.prompt_token_ids, new.output_token_ids) if list_]
    targets += [d.ids for d in so.scheduled_spec_decode_tokens]
    return _replace_one(targets, bad, draw)


def bad_block(so, model, draw) -> bool:
    bad = draw(st.one_of(st.sampled_from([0, -1, 2**31 - 1, -(2**31)]),
                         st.integers(model.garbage_blocks[1], 2**31 - 1)))
    return _replace_one(_block_lists(so), bad, draw)


def block_twice(so, model, draw) -> bool:
    targets = _block_lists(so)
    if targets:
        target = draw(st.sampled_from(targets))
        target.append(target[0])
        return True
    c = _cached(so)  # or a block the request already holds, sent again
    for i, req_id in enumerate(c.req_ids):
        held = model.requests[req_id].blocks
        if held and req_id not in c.resumed_req_ids:
            c.new_block_ids[i].ids.append(held[0])
            return True
    return False


def ragged_cached(so, model, draw) -> bool:
    c = _cached(so)
    field = draw(st.sampled_from(["new_block_ids", "num_computed_tokens", "num_scheduled_tokens",
                                  "req_ids"]))
    values = getattr(c, field)
    if values and draw(st.booleans()):
        del values[-1]
    elif field == "new_block_ids":
        values.add()
    elif field == "req_ids":
        values.append(ID_PREFIX + "ragged")
    else:
        values.append(0)
    return True


def resumed_not_scheduled(so, model, draw) -> bool:
    req_id = draw(st.sampled_from([ID_PREFIX + "0", "ghost", ""]))
    _cached(so).resumed_req_ids.append(req_id)
    return req_id not in _cached(so).req_ids


def bad_counts(so, model, draw) -> bool:
    entries = [(new, "num_computed_tokens") for new in so.scheduled_new_reqs]
    entries += [(new, "num_scheduled_tokens") for new in so.scheduled_new_reqs]
    c = _cached(so)
    if not entries and not c.req_ids:
        return False
    if entries and (not c.req_ids or draw(st.booleans())):
        new, field = draw(st.sampled_from(entries))
        value = draw(st.sampled_from([-1, -(2**31), 2**31 - 1,
                                      len(new.prompt_token_ids) + len(new.output_token_ids) + 1]))
        if field == "num_scheduled_tokens":
            _set_total(so, so.total_num_scheduled_tokens + value - new.num_scheduled_tokens)
        setattr(new, field, value)
        return True
    i = draw(st.integers(0, len(c.req_ids) - 1))
    which = draw(st.sampled_from([c.num_computed_tokens, c.num_scheduled_tokens]))
    which[i] = draw(st.sampled_from([-1, -(2**31), 2**31 - 1]))
    return True


def _bad_sampling(draw) -> tuple[str, object]:
    return draw(st.sampled_from([
        ("temperature", math.nan), ("temperature", -1.0), ("temperature", math.inf),
        ("top_p", 0.0), ("top_p", 2.0), ("top_p", math.nan), ("min_p", 2.0), ("min_p", -0.5),
        ("min_p", math.nan), ("top_k", -5), ("top_k", -(2**31)), ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf), ("presence_penalty", 3.0),
        ("presence_penalty", math.nan), ("frequency_penalty", -math.inf), ("min_tokens", -1),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", 2**31 - 1), ("prompt_logprobs", -3),
        ("prompt_logprobs", 10**6), ("logit_bias", math.nan), ("logit_bias", 1e9),
        ("logit_bias_key", -1), ("logit_bias_key", 2**31 - 1), ("allowed_token_ids", -7),
        ("allowed_token_ids", 10**9), ("bad_words", None), ("bad_words", -1),
    ]))


def bad_sampling(so, model, draw) -> bool:
    if not so.scheduled_new_reqs:
        return False
    s = so.scheduled_new_reqs[draw(st.integers(0, len(so.scheduled_new_reqs) - 1))].sampling
    field, value = _bad_sampling(draw)
    if field == "logit_bias":
        s.logit_bias[0] = value
    elif field == "logit_bias_key":
        s.logit_bias[value] = 1.0
    elif field == "allowed_token_ids":
        s.allowed_token_ids.append(value)
    elif field == "bad_words":
        s.bad_words.add(ids=[] if value is None else [value])
    else:
        setattr(s, field, value)
    return True


def too_many_requests(so, model, draw) -> bool:
    start = len(_cached(so).req_ids) + len(so.scheduled_new_reqs)
    blocks = iter(range(model.garbage_blocks[0], model.garbage_blocks[1]))
    for i in range(model.max_num_reqs + 1 - start):
        so.scheduled_new_reqs.add(req_id=f"flood-{i}", prompt_token_ids=[3],
                                  block_ids=[next(blocks)], num_scheduled_tokens=1)
        so.total_num_scheduled_tokens += 1
    return True


def too_many_tokens(so, model, draw) -> bool:
    prompt = [5] * (model.max_model_len - 1)
    first = model.garbage_blocks[0]
    count = -(-len(prompt) // model.block_size)
    so.scheduled_new_reqs.add(req_id="flood-long", prompt_token_ids=prompt,
                              block_ids=range(first, first + count),
                              num_scheduled_tokens=len(prompt))
    so.total_num_scheduled_tokens += len(prompt)
    return so.total_num_scheduled_tokens > model.budget


def prompt_too_long(so, model, draw) -> bool:
    length = draw(st.sampled_from([model.max_model_len, model.max_model_len + 1, 100_000]))
    so.scheduled_new_reqs.add(req_id="flood-prompt", prompt_token_ids=[7] * length,
                              block_ids=[model.garbage_blocks[0]], num_scheduled_tokens=1)
    so.total_num_scheduled_tokens += 1
    return True


def empty_prompt(so, model, draw) -> bool:
    so.scheduled_new_reqs.add(req_id="flood-empty", block_ids=[model.garbage_blocks[0]])
    return True


def bad_drafts(so, model, draw) -> bool:
    kind = draw(st.sampled_from(["unscheduled", "empty", "twice", "mid-prefill"]))
    if kind == "unscheduled":
        so.scheduled_spec_decode_tokens.add(req_id="ghost", ids=[1])
    elif kind == "empty":
        if not so.scheduled_spec_decode_tokens:
            return False
        del so.scheduled_spec_decode_tokens[0].ids[:]
    elif kind == "twice":
        if not so.scheduled_spec_decode_tokens:
            return False
        so.scheduled_spec_decode_tokens.append(so.scheduled_spec_decode_tokens[0])
    else:
        tokens = {n.req_id: len(n.prompt_token_ids) + len(n.output_token_ids)
                  for n in so.scheduled_new_reqs}
        mid = [n for n in so.scheduled_new_reqs if n.num_computed_tokens != tokens[n.req_id] - 1]
        if not mid:
            return False
        so.scheduled_spec_decode_tokens.add(req_id=mid[0].req_id, ids=[1, 2])
        mid[0].num_scheduled_tokens += 2
        so.total_num_scheduled_tokens += 2
    return True


def ragged_new_tokens(so, model, draw) -> bool:
    """cached_new_token_ids, when sent, runs parallel to the cached ids."""
    so.cached_new_token_ids.add(ids=[1])
    for _ in range(len(_cached(so).req_ids) + draw(st.integers(0, 2))):
        so.cached_new_token_ids.add(ids=[2])
    return True


def too_few_blocks(so, model, draw) -> bool:
    targets = [new for new in so.scheduled_new_reqs if new.block_ids]
    if not targets:
        return False
    del targets[0].block_ids[-1]
    return True


MUTATIONS: dict[str, Mutation] = {f.__name__: f for f in (
    wrong_total, unknown_cached, cached_twice, new_already_running, new_twice, empty_new_id,
    bad_token, bad_block, block_twice, ragged_cached, resumed_not_scheduled, bad_counts,
    bad_sampling, too_many_requests, too_many_tokens, prompt_too_long, empty_prompt, bad_drafts,
    ragged_new_tokens, too_few_blocks,
)}


def hostile_grammar(plan: StepPlan, vocab_size: int, draw) -> pb.GrammarOutput | None:
    """A GrammarOutput for the plan's step that the worker must refuse; None if none fits."""
    words = -(-vocab_size // 32)
    sampling = [r for r in plan.scheduled if r not in plan.drafts]
    row = b"\xff" * (4 * words)
    kind = draw(st.sampled_from(["short", "long", "unknown", "empty row", "past vocab",
                                 "twice", "drafted", "garbage"]))
    g = pb.GrammarOutput()
    if kind == "garbage":
        g.req_ids.extend(draw(st.lists(JUNK_TEXT, min_size=1, max_size=3)))
        g.bitmask = draw(st.binary(max_size=3 * 4 * words + 8))
        if len(g.bitmask) == len(g.req_ids) * 4 * words and set(g.req_ids) <= set(sampling):
            return None  # a valid shape on known rows: not hostile for sure
        return g
    if kind == "unknown":
        g.req_ids.append(draw(st.sampled_from(["ghost", "", ID_PREFIX + "999999"])))
        g.bitmask = row
        return g
    if kind == "drafted":
        if not plan.drafts:
            return None
        g.req_ids.append(next(iter(plan.drafts)))
        g.bitmask = row
        return g
    if not sampling:
        return None
    g.req_ids.append(draw(st.sampled_from(sampling)))
    if kind == "short":
        g.bitmask = row[: draw(st.integers(0, len(row) - 1))]
    elif kind == "long":
        g.bitmask = row + b"\x00" * draw(st.integers(1, 8))
    elif kind == "empty row":
        g.bitmask = b"\x00" * len(row)
    elif kind == "past vocab":  # bits only for ids past the vocabulary
        if vocab_size % 32 == 0:
            return None
        g.bitmask = b"\x00" * (len(row) - 4) + (~((1 << vocab_size % 32) - 1) & 0xFFFFFFFF
                                                ).to_bytes(4, "little")
    else:  # one request named twice, rows that together allow no token
        g.req_ids.append(g.req_ids[0])
        g.bitmask = b"\x01" + b"\x00" * (len(row) - 1) + b"\x02" + b"\x00" * (len(row) - 1)
    return g


@st.composite
def garbage_scheduler_output(draw, model: SchedulerModel) -> pb.SchedulerOutput:
    """A SchedulerOutput built from scratch with wild values; it never names the model's
    requests and takes valid-looking blocks only from the half of the pool the model leaves."""
    ids = JUNK_TEXT.filter(lambda s: not s.startswith(ID_PREFIX))
    lo, hi = model.garbage_blocks
    blocks = st.lists(st.one_of(st.integers(lo, hi - 1), st.integers(-(2**31), 0),
                                st.integers(hi, 2**31 - 1)), max_size=6)
    tokens = st.lists(st.one_of(st.integers(0, model.vocab_size - 1), INT32), max_size=12)
    so = pb.SchedulerOutput(step_id=draw(st.integers(0, 2**64 - 1)))
    for _ in range(draw(st.integers(0, 3))):
        s = pb.RequestSamplingParams(
            temperature=draw(WILD_FLOATS), top_p=draw(WILD_FLOATS), top_k=draw(INT32),
            min_p=draw(WILD_FLOATS), repetition_penalty=draw(WILD_FLOATS),
            presence_penalty=draw(WILD_FLOATS), frequency_penalty=draw(WILD_FLOATS),
            min_tokens=draw(INT32), stop_token_ids=draw(tokens))
        if draw(st.booleans()):
            s.logprobs = draw(INT32)
        if draw(st.booleans()):
            s.json_schema = draw(st.text(max_size=20))
        so.scheduled_new_reqs.add(
            req_id=draw(ids), prompt_token_ids=draw(tokens), output_token_ids=draw(tokens),
            sampling=s, block_ids=draw(blocks), num_computed_tokens=draw(INT32),
            num_scheduled_tokens=draw(st.one_of(st.integers(0, 16), INT32)))
    c = so.scheduled_cached_reqs
    for _ in range(draw(st.integers(0, 2))):
        c.req_ids.append(draw(ids))
        c.new_block_ids.add(ids=draw(blocks))
        c.num_computed_tokens.append(draw(INT32))
        c.num_scheduled_tokens.append(draw(INT32))
    if draw(st.booleans()):
        c.resumed_req_ids.extend(draw(st.lists(ids, max_size=2)))
    so.finished_req_ids.extend(draw(st.lists(ids, max_size=3)))
    for _ in range(draw(st.integers(0, 1))):
        so.scheduled_spec_decode_tokens.add(req_id=draw(ids), ids=draw(tokens))
    for _ in range(draw(st.integers(0, 1))):
        so.cached_new_token_ids.add(ids=draw(tokens))
    computed = sum(n.num_scheduled_tokens for n in so.scheduled_new_reqs)
    computed += sum(c.num_scheduled_tokens)
    so.total_num_scheduled_tokens = draw(st.sampled_from(
        [max(-(2**31), min(2**31 - 1, computed)), 0, 2**31 - 1]))
    return so


def touches_model(so: pb.SchedulerOutput, model: SchedulerModel) -> bool:
    """True when a message (e.g. random bytes that parsed) names an id of the model's or
    lists a block of the model's half of the pool: accepted, it would change the model's
    requests, which the reference worker never sees."""
    c = so.scheduled_cached_reqs
    names = [n.req_id for n in so.scheduled_new_reqs] + list(c.req_ids) + list(c.resumed_req_ids)
    names += list(so.finished_req_ids) + [d.req_id for d in so.scheduled_spec_decode_tokens]
    blocks = [b for n in so.scheduled_new_reqs for b in n.block_ids]
    blocks += [b for ids in c.new_block_ids for b in ids.ids]
    return (any(n.startswith(ID_PREFIX) for n in names)
            or any(0 < b < model.garbage_blocks[0] for b in blocks))
