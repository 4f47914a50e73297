"""One rule set across the seam (common/sampling_rules.py), as a property over the whole
SamplingParams space: whatever admission accepts, the worker's check of the wire accepts, in the
SchedulerOutput the real scheduler builds for it; whatever the worker would refuse, admission
refuses with INVALID_ARGUMENT naming one of the fields that break a rule."""

from __future__ import annotations

import math

import pytest
from batchwire.v1 import worker_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc import SamplingParams
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.service.status_codes import status_for
from tests.scheduler.conftest import make_scheduler
from worker_svc.batch.validation import InvalidStepError, StepLimits, validate_scheduler_output

VOCAB = 512
PROMPT = [5, 6, 7]

# Edges of every range, both float32 edges (overflow, rounding to 0) and the non-finite values.
WILD_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 2.0, -2.0, 100.0, -100.0,
                     2.0000001, 1.0000001, 1e-46, 1e-40, 3.4e38, 3.5e38, 1e39, 1e308, -1e-46]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3.0, 3.0),
)
WILD_INTS = st.one_of(st.sampled_from([-2, -1, 0, 1, 20, 21, VOCAB - 1, VOCAB, 2**31 - 1, 2**31,
                                       2**63, 2**64 - 1, 2**64]),
                      st.integers(-(2**65), 2**65), st.integers(-3, 40))
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), WILD_INTS)
FIELDS = {
    "temperature": WILD_FLOATS, "top_p": WILD_FLOATS, "min_p": WILD_FLOATS,
    "presence_penalty": WILD_FLOATS, "frequency_penalty": WILD_FLOATS,
    "repetition_penalty": WILD_FLOATS, "top_k": WILD_INTS, "seed": WILD_INTS,
    "min_tokens": WILD_INTS, "max_tokens": st.one_of(st.integers(1, 50), WILD_INTS),
    "logprobs": WILD_INTS, "prompt_logprobs": WILD_INTS,
    "stop_token_ids": st.lists(TOKEN_IDS, max_size=3),
    "allowed_token_ids": st.lists(TOKEN_IDS, max_size=3),
    "logit_bias": st.dictionaries(TOKEN_IDS, WILD_FLOATS, max_size=3),
    "ignore_eos": st.booleans(),
}
SAMPLING = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=6).flatmap(
    lambda chosen: st.fixed_dictionaries({name: FIELDS[name] for name in chosen}))
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


NUM_BLOCKS = 8
MAX_MODEL_LEN = 64


def _scheduler():
    return make_scheduler(num_blocks=NUM_BLOCKS, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)


LIMITS = StepLimits(vocab_size=VOCAB, num_blocks=NUM_BLOCKS, block_size=16,
                    max_model_len=MAX_MODEL_LEN, max_num_reqs=16, max_num_batched_tokens=2048,
                    max_logprobs=_scheduler().limits.max_logprobs)


def _admit(fields: dict) -> tuple[worker_pb2.SchedulerOutput | None, InvalidRequestError | None]:
    """Admission as a service runs it (SamplingParams, then the scheduler's checks), and the step
    the scheduler then sends."""
    scheduler = _scheduler()
    try:
        scheduler.add_request(PROMPT, SamplingParams(**fields), request_id="r")
    except InvalidRequestError as e:
        return None, e
    return scheduler.schedule(), None


def _wire(fields: dict) -> worker_pb2.RequestSamplingParams | None:
    """The same values written straight onto the wire, admission bypassed; None where the wire
    cannot carry them (an int beyond its field)."""
    msg = worker_pb2.RequestSamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
    try:
        for name, value in fields.items():
            if name in ("stop_token_ids", "allowed_token_ids"):
                getattr(msg, name).extend(value)
            elif name == "logit_bias":
                msg.logit_bias.update(value)
            elif name not in ("max_tokens", "ignore_eos"):  # not on the wire
                setattr(msg, name, value)
    except (ValueError, TypeError):
        return None
    return msg


@SETTINGS
@given(SAMPLING)
def test_admission_and_the_worker_apply_one_rule_set(fields):
    so, refusal = _admit(fields)
    if refusal is None:
        assert so is not None and len(so.scheduled_new_reqs) == 1
        validate_scheduler_output(so, {}, LIMITS)  # accepted there: accepted here
        return
    assert status_for(refusal)[0].name == "INVALID_ARGUMENT"
    assert refusal.field in fields, (refusal.field, fields)  # names a field the client set


@SETTINGS
@given(SAMPLING)
def test_what_the_worker_refuses_admission_refused_first(fields):
    wire = _wire(fields)
    if wire is None:
        return
    base = _admit({})[0]
    assert base is not None
    base.scheduled_new_reqs[0].sampling.CopyFrom(wire)
    if "ignore_eos" not in fields or not fields["ignore_eos"]:
        base.scheduled_new_reqs[0].sampling.stop_token_ids.append(2)  # the scheduler's EOS
    try:
        validate_scheduler_output(base, {}, LIMITS)
    except InvalidStepError as e:
        assert e.req_ids == [base.scheduled_new_reqs[0].req_id]  # the refusal names it
        worker_field = str(e).split("sampling.", 1)[1].split("=", 1)[0]
        _, refusal = _admit(fields)
        assert refusal is not None, f"the worker refuses {fields}: {e}"
        assert refusal.field in fields
        assert worker_field in fields


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": math.inf}, {"temperature": 1e39}, {"top_p": 1e-46},
    {"repetition_penalty": 1e-46}, {"logit_bias": {3: 1e308}}, {"logit_bias": {3: math.inf}},
    {"logit_bias": {3: 100.5}}, {"logit_bias": {VOCAB: 1.0}}, {"stop_token_ids": [VOCAB]},
])
def test_values_that_reached_the_worker_are_refused_at_admission_naming_the_field(fields):
    _, refusal = _admit(fields)
    assert refusal is not None
    assert refusal.field == next(iter(fields))
