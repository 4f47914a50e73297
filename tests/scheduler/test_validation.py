"""Every refusal names the field and the value; nothing invalid reaches the queue."""

from __future__ import annotations

import math

import pytest

from scheduler_svc import InvalidRequestError, QueueFullError, SamplingParams
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.errors import RequestIdInUseError

from .conftest import make_fake_engine, make_prompt, make_scheduler

VOCAB = 1000

PARAM_CASES = [
    # (field, bad value)
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # above max_tokens=16
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0),
    ("stop", [""]),
    ("seed", -1),
    ("seed", 2**64),
    ("top_k", 2**31),
    ("top_k", 1.5),
    ("max_tokens", "16"),
    ("temperature", "hot"),
    ("stop", [3]),
    ("stop_token_ids", ["x"]),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: "high"}),
    ("allowed_token_ids", [1.5]),
    ("bad_words", [""]),
    ("bad_words", [7]),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", 2.5),
]


@pytest.mark.parametrize("field, value", PARAM_CASES)
def test_bad_sampling_params_are_refused_naming_field_and_value(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    assert isinstance(e.value, ValueError)  # so callers that catch ValueError still do
    shown = repr(value[0]) if isinstance(value, list) else repr(value)  # a list: the bad element
    assert shown in str(e.value)


@pytest.mark.parametrize("field, value", [("top_k", 0), ("top_k", -1), ("min_tokens", 16),
                                          ("temperature", 0.0), ("top_p", 1.0)])
def test_boundary_values_are_accepted(field, value):
    SamplingParams(**{field: value})


def test_empty_allowed_list_is_refused_and_biases_out_of_range_are_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(allowed_token_ids=[])
    assert e.value.field == "allowed_token_ids"
    # As OpenAI does: a bias outside [-100, 100], or not finite, is refused, not clamped.
    for bias in (250, -1e9, 100.5, float("inf"), float("nan"), 1e308):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias={3: bias})
        assert e.value.field == "logit_bias"
    assert SamplingParams(logit_bias={3: 100, 4: -100.0, 5: 0.5}).logit_bias == {
        3: 100.0, 4: -100.0, 5: 0.5}


REQUEST_CASES = [
    # (field, prompt, sampling kwargs)
    ("prompt", [], {}),
    ("prompt", make_prompt(64), {}),  # == max_model_len
    ("prompt", make_prompt(70), {}),
    ("prompt_token_ids", [5, VOCAB, 6], {}),
    ("prompt_token_ids", [-1], {}),
    ("logprobs", [5], {"logprobs": 21}),
    ("stop_token_ids", [5], {"stop_token_ids": [VOCAB]}),
    ("stop", [5], {"stop": ["x"]}),  # no tokenizer to find it with
    ("logit_bias", [5], {"logit_bias": {VOCAB: 1.0}}),
    ("allowed_token_ids", [5], {"allowed_token_ids": [7, VOCAB]}),
    ("bad_words", [5], {"bad_words": ["x"]}),  # no tokenizer to spell it with
    ("truncate_prompt_tokens", make_prompt(70), {"truncate_prompt_tokens": 64}),
]


def test_truncation_keeps_the_last_tokens_and_rescues_a_long_prompt():
    s = make_scheduler(vocab_size=VOCAB, max_model_len=64, max_num_batched_tokens=64)
    request = s.add_request(make_prompt(70), SamplingParams(truncate_prompt_tokens=10))
    assert request.prompt_token_ids == make_prompt(70)[-10:] and request.num_prompt_tokens == 10
    short = s.add_request(make_prompt(5), SamplingParams(truncate_prompt_tokens=10))
    assert short.prompt_token_ids == make_prompt(5)


@pytest.mark.parametrize("field, prompt, kwargs", REQUEST_CASES)
def test_bad_requests_are_refused_before_queueing(field, prompt, kwargs):
    s = make_scheduler(vocab_size=VOCAB, max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(prompt, SamplingParams(**kwargs))
    assert e.value.field == field
    assert len(s.waiting) == 0 and not s.requests


def test_full_queue_is_refused():
    s = make_scheduler(max_queued_requests=2)
    for i in range(2):
        s.add_request(make_prompt(4, 100 * i), SamplingParams())
    with pytest.raises(QueueFullError):
        s.add_request(make_prompt(4), SamplingParams())


def test_duplicate_request_id_is_refused_while_running():
    # The engine keeps the map from the client's id to the request, so the engine refuses.
    engine, _ = make_fake_engine(32, 4, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request([3, 4, 5, 6], params, request_id="x")
    with pytest.raises(RequestIdInUseError, match="already in use"):
        engine.add_request([3, 4, 5, 6], params, request_id="x")
    while engine.has_requests():
        engine.step()
    engine.add_request([3, 4, 5, 6], params, request_id="x")  # free again once finished


@pytest.mark.parametrize("kwargs, word", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(policy="lifo"), "policy"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
     "chunked"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
])
def test_config_is_validated_at_start_up(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SchedulerConfig(**kwargs)


def test_kv_pool_smaller_than_one_max_length_request_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=4, block_size=16, max_model_len=64)


@pytest.mark.parametrize("limits, kwargs, message", [
    (dict(max_stop_strings=2), dict(stop=["a", "b", "c"]), "3 strings; the limit is "
     "max_stop_strings=2"),
    (dict(max_stop_chars=5), dict(stop=["abc", "def"]), "6 characters in all"),
    (dict(max_stop_strings=1), dict(bad_words=["x", "y"]), "max_stop_strings=1"),
    (dict(max_token_ids=3), dict(stop_token_ids=[5, 6, 7, 8]), "4 entries; the limit is "
     "max_token_ids=3"),
    (dict(max_token_ids=1), dict(logit_bias={5: 1.0, 6: 2.0}), "max_token_ids=1"),
    (dict(max_token_ids=1), dict(allowed_token_ids=[5, 6]), "max_token_ids=1"),
])
def test_list_caps_are_configurable_and_name_the_field(limits, kwargs, message):
    s = make_scheduler(vocab_size=VOCAB, **limits)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(make_prompt(4), SamplingParams(**kwargs))
    assert e.value.field == next(iter(kwargs)) and message in e.value.message, e.value
    s.add_request(make_prompt(4), SamplingParams())  # at the cap or under it: accepted
    assert len(s.waiting) == 1
