"""update_from_output's stop rules, one test each, and the detokenizer's stop strings."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core.detokenizer import IncrementalDetokenizer
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.sampling_params import SamplingParams

from .conftest import ByteTokenizer, make_prompt, make_scheduler, run_step

EOS = 2


def generate(scheduler, params, tokens, prompt_len=4, prompt=None):
    """Feeds `tokens` one per step to a single request; returns its outputs until it finishes."""
    request = scheduler.add_request(prompt or make_prompt(prompt_len), params)
    outputs = []
    for token in tokens:
        _, outs = run_step(scheduler, token)
        outputs += outs
        if outs and outs[-1].finished:
            break
    return request, outputs


def test_eos_stops_with_no_stop_reason():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=10), [5, 6, EOS, 7])
    assert r.output_token_ids == [5, 6, EOS]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)


def test_ignore_eos_runs_on_to_max_tokens():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=4, ignore_eos=True),
                       [EOS, EOS, EOS, EOS, EOS])
    assert r.output_token_ids == [EOS] * 4 and outs[-1].finish_reason == "length"


def test_min_tokens_suppresses_an_early_eos():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=10, min_tokens=3),
                       [EOS, 5, EOS, 6])
    assert r.output_token_ids == [EOS, 5, EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == 3


def test_stop_token_id_is_the_stop_reason():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=10, stop_token_ids=[9]),
                       [5, 9, 6])
    assert r.output_token_ids == [5, 9]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", 9)


def test_max_tokens_is_length():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=3), [5, 6, 7, 8])
    assert r.output_token_ids == [5, 6, 7] and outs[-1].finish_reason == "length"


def test_a_request_longer_than_max_model_len_is_refused_naming_both_numbers():
    s = make_scheduler(max_model_len=6)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(make_prompt(4), SamplingParams(max_tokens=100))
    assert e.value.field == "max_tokens"
    assert "4-token prompt" in e.value.message and "max_model_len (6)" in e.value.message
    assert "at most 2" in e.value.message and not s.requests
    r, outs = generate(s, SamplingParams(max_tokens=2, min_tokens=2), [5, 6, 7], prompt_len=4)
    assert r.num_tokens == 6 and outs[-1].finish_reason == "length"


def test_a_stop_token_on_the_last_allowed_token_reports_stop():
    r, outs = generate(make_scheduler(), SamplingParams(max_tokens=2), [5, EOS])
    assert outs[-1].finish_reason == "stop"


def test_finished_request_frees_its_blocks_and_tells_the_worker_next_step():
    s = make_scheduler(num_blocks=10, block_size=4, max_model_len=32)
    r, _ = generate(s, SamplingParams(max_tokens=1), [5])
    assert s.kv.num_free_blocks == 9 and not s.requests
    s.add_request(make_prompt(3), SamplingParams(max_tokens=1))
    so, _ = run_step(s)
    assert list(so.finished_req_ids) == [r.wire_id]
    so, _ = run_step(s)
    assert len(so.finished_req_ids) == 1  # the second request, once


# The detokenizer with a byte-level vocabulary: ids 1.. map to these byte strings.
PIECES = [b"abc", b"xS", b"TOPy", b"\xf0\x9f", b"\x98\x80", b" ok"]
ABC, XS, TOPY, SMILE_1, SMILE_2, OK = range(1, 7)


def stream(detok: IncrementalDetokenizer, ids: list[int], finish_last: bool = True):
    deltas, stop = [], None
    for i, t in enumerate(ids):
        delta, stop = detok.update([t], finished=finish_last and i == len(ids) - 1)
        deltas.append(delta)
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("include, last", [(False, "cx"), (True, "cxSTOP")])
def test_stop_string_split_across_two_tokens(include, last):
    detok = IncrementalDetokenizer(ByteTokenizer(PIECES), [OK], ["STOP"], include)
    deltas, stop = stream(detok, [ABC, XS, TOPY, ABC], finish_last=False)
    assert stop == "STOP"
    # The last len("STOP") - 1 characters are held back until they cannot start "STOP", so the
    # "S" of "xS" is never streamed before the cut.
    assert deltas == ["", "ab", last]
    assert detok.text == "ab" + last


def test_stop_string_through_update_from_output():
    s = make_scheduler(vocab_size=len(PIECES) + 1, eos_token_ids=(0,),
                       tokenizer=ByteTokenizer(PIECES))
    r, outs = generate(s, SamplingParams(max_tokens=10, stop=["STOP"]), [ABC, XS, TOPY, ABC],
                       prompt=[OK])
    assert r.output_token_ids == [ABC, XS, TOPY]  # the tokens stay; the text is cut
    assert "".join(o.new_text for o in outs) == "abcx"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "STOP")


def test_character_split_across_tokens_waits_for_its_second_half():
    detok = IncrementalDetokenizer(ByteTokenizer(PIECES), [ABC])
    deltas, _ = stream(detok, [SMILE_1, SMILE_2, OK])
    assert deltas == ["", "\U0001f600", " ok"]


def test_finish_flushes_an_incomplete_character():
    detok = IncrementalDetokenizer(ByteTokenizer(PIECES), [ABC])
    deltas, _ = stream(detok, [OK, SMILE_1])
    assert "".join(deltas) == " ok\ufffd"


def test_earliest_stop_string_wins():
    # Both end in the last token's text "abcxSTOPy"; the one that starts first cuts the text.
    detok = IncrementalDetokenizer(ByteTokenizer(PIECES), [OK], ["OPy", "STO"])
    _, stop = stream(detok, [ABC, XS, TOPY], finish_last=False)
    assert stop == "STO" and detok.text == "abcx"


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_text_is_the_decode_of_the_whole_output(default_tokenizer, seed):
    """Long runs (past the detokenizer's window cut) of ids that split multi-byte characters,
    streamed one token a step, add up to the tokenizer's decode of the whole output."""
    rng = random.Random(seed)
    text = "héllo wörld — ünïcode 日本語の文章 🙂 emoji ok. " * 4
    ids = default_tokenizer(text).input_ids + [rng.randrange(100, 49000) for _ in range(60)]
    prompt = default_tokenizer("Say something:").input_ids
    detok = IncrementalDetokenizer(default_tokenizer, prompt)
    streamed = "".join(detok.update([t], finished=i == len(ids) - 1)[0]
                       for i, t in enumerate(ids))
    assert streamed == default_tokenizer.decode(ids, skip_special_tokens=True)
