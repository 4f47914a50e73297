"""The output processor on its own: a stop string cuts an output after the token that completed
it (tokens, logprobs, counts), drops what the engine sent after it until the engine confirms the
end, and leaves a token rule's reason alone when both end the request on the same token."""

from __future__ import annotations

from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.outputs import EngineCoreOutput, TokenLogprobs
from scheduler_svc.core.sampling_params import SamplingParams

from .conftest import ByteTokenizer

PIECES = [b"ab", b"xS", b"TOPy", b"cd"]
AB, XS, TOPY, CD = range(1, 5)
PROMPT = [CD, CD]


def _out(ids, num_output_tokens, finished=False, reason=None, logprobs=False):
    lps = [TokenLogprobs([t], [-0.5], 1) for t in ids] if logprobs else None
    return EngineCoreOutput("r", list(ids), finished=finished, finish_reason=reason,
                            num_prompt_tokens=len(PROMPT), num_output_tokens=num_output_tokens,
                            new_logprobs=lps)


def _processor(**params):
    p = OutputProcessor(ByteTokenizer(PIECES))
    p.add_request("r", PROMPT, SamplingParams(max_tokens=20, stop=["STOP"], **params))
    return p


def test_a_stop_string_inside_a_many_token_output_cuts_it_after_its_token():
    p = _processor()
    shown, stops = p.process([_out([AB], 1)])
    assert [o.new_text for o in shown] == [""] and not stops  # held back: "STOP" could start
    shown, stops = p.process([_out([XS, TOPY, CD], 4, logprobs=True)])
    (out,) = shown
    assert out.new_token_ids == [XS, TOPY] and len(out.new_logprobs) == 2
    assert (out.new_text, out.num_output_tokens) == ("abx", 3)
    assert (out.finished, out.finish_reason, out.stop_reason) == (True, "stop", "STOP")
    assert stops == {"r": (3, "STOP")}
    # What the engine sampled before it heard of the stop, then its confirmation: dropped.
    assert p.process([_out([CD], 5)]) == ([], {})
    assert p.process([_out([], 3, finished=True, reason="stop")]) == ([], {})
    assert "r" not in p


def test_a_token_rule_on_the_same_token_keeps_its_reason_and_the_text_is_cut():
    p = _processor(include_stop_str_in_output=True)
    p.process([_out([AB, XS], 2)])
    shown, stops = p.process([_out([TOPY], 3, finished=True, reason="length")])
    assert (shown[0].new_text, shown[0].finish_reason, shown[0].stop_reason) == (
        "bxSTOP", "length", None)
    assert not stops and "r" not in p


def test_a_request_whose_client_went_away_shows_nothing_until_the_engine_confirms_its_end():
    p = _processor()
    p.process([_out([AB], 1)])
    p.end("r")  # the server's stream closed: the abort is on its way to the engine
    assert p.process([_out([XS, TOPY], 3)]) == ([], {})  # no text made, no stop reported
    assert "r" in p, "the id is kept until the engine's own end"
    assert p.process([_out([], 3, finished=True, reason="abort")]) == ([], {})
    assert "r" not in p


def test_a_forgotten_request_passes_through_untouched():
    p = _processor()
    p.forget("r")  # its admission was refused, or it failed
    out = _out([XS, TOPY], 2)
    assert p.process([out]) == ([out], {}) and out.new_text == "" and not out.finished
