"""Every invalid input gets INVALID_ARGUMENT naming its field, is never scheduled (so costs no
engine step), and the server keeps serving. The rules are scheduler_svc/sampling_params.py's,
as a client spells them."""

from __future__ import annotations

import grpc
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import collect, greedy, text_request

pytestmark = pytest.mark.slow

S = generate_pb2.SamplingParams
R = generate_pb2.GenerateRequest
M = generate_pb2.ChatMessage

CASES = [
    # (case id, request, the field the status message must start with)
    ("temperature<0", text_request("Hi", S(temperature=-0.5)), "sampling.temperature"),
    ("temperature=nan", text_request("Hi", S(temperature=float("nan"))), "sampling.temperature"),
    ("temperature=inf", text_request("Hi", S(temperature=float("inf"))), "sampling.temperature"),
    ("top_p=0", text_request("Hi", S(top_p=0)), "sampling.top_p"),
    ("top_p>1", text_request("Hi", S(top_p=1.5)), "sampling.top_p"),
    ("top_k<-1", text_request("Hi", S(top_k=-2)), "sampling.top_k"),
    ("min_p<0", text_request("Hi", S(min_p=-0.1)), "sampling.min_p"),
    ("min_p>1", text_request("Hi", S(min_p=1.1)), "sampling.min_p"),
    ("max_tokens=0", text_request("Hi", S(max_tokens=0)), "sampling.max_tokens"),
    ("max_tokens<0", text_request("Hi", S(max_tokens=-3)), "sampling.max_tokens"),
    ("prompt+max_tokens>max_model_len", text_request("Hi", S(max_tokens=5000)),
     "sampling.max_tokens"),
    ("min_tokens<0", text_request("Hi", S(min_tokens=-1)), "sampling.min_tokens"),
    ("min_tokens>max", text_request("Hi", S(max_tokens=4, min_tokens=5)), "sampling.min_tokens"),
    ("presence>2", text_request("Hi", S(presence_penalty=2.5)), "sampling.presence_penalty"),
    ("frequency<-2", text_request("Hi", S(frequency_penalty=-2.5)),
     "sampling.frequency_penalty"),
    ("repetition=0", text_request("Hi", S(repetition_penalty=0)), "sampling.repetition_penalty"),
    ("logprobs<0", text_request("Hi", S(logprobs=-1)), "sampling.logprobs"),
    ("logprobs>max", text_request("Hi", S(logprobs=21)), "sampling.logprobs"),
    ("empty stop string", text_request("Hi", S(stop=["ok", ""])), "sampling.stop"),
    ("stop id out of vocab", text_request("Hi", S(stop_token_ids=[49152])),
     "sampling.stop_token_ids"),
    ("stop id negative", text_request("Hi", S(stop_token_ids=[-1])), "sampling.stop_token_ids"),
    ("bias out of vocab", text_request("Hi", S(logit_bias={49152: 1.0})), "sampling.logit_bias"),
    ("bias nan", text_request("Hi", S(logit_bias={5: float("nan")})), "sampling.logit_bias"),
    ("allowed id out of vocab", text_request("Hi", S(allowed_token_ids=[3, 49152])),
     "sampling.allowed_token_ids"),
    ("empty bad word", text_request("Hi", S(bad_words=["ok", ""])), "sampling.bad_words"),
    ("truncate=0", text_request("Hi", S(truncate_prompt_tokens=0)),
     "sampling.truncate_prompt_tokens"),
    ("truncate>=max_model_len", R(token_ids=[100] * 300, sampling=S(truncate_prompt_tokens=256)),
     "sampling.truncate_prompt_tokens"),
    ("n=0", text_request("Hi", S(n=0)), "sampling.n"),
    ("n>max_n", text_request("Hi", S(n=17)), "sampling.n"),
    ("prompt_logprobs<0", text_request("Hi", S(prompt_logprobs=-1)), "sampling.prompt_logprobs"),
    ("prompt_logprobs>max", text_request("Hi", S(prompt_logprobs=21)),
     "sampling.prompt_logprobs"),
    ("no prompt", R(sampling=S(max_tokens=2)), "prompt"),
    # The caps on a request's lists (SchedulerConfig.max_stop_strings, max_stop_chars,
    # max_token_ids), which keep one request from slowing every step of the others.
    ("65 stop strings", text_request("Hi", S(stop=[f"s{i}" for i in range(65)])),
     "sampling.stop: 65 strings; the limit is max_stop_strings=64"),
    ("stop strings past 4096 chars", text_request("Hi", S(stop=["x" * 2049, "y" * 2048])),
     "sampling.stop: 4097 characters in all; the limit is max_stop_chars=4096"),
    ("65 bad words", text_request("Hi", S(bad_words=[f"w{i}" for i in range(65)])),
     "sampling.bad_words: 65 strings"),
    ("2049 stop ids", text_request("Hi", S(stop_token_ids=list(range(2049)))),
     "sampling.stop_token_ids: 2049 entries; the limit is max_token_ids=2048"),
    ("2049 biases", text_request("Hi", S(logit_bias={i: 1.0 for i in range(2049)})),
     "sampling.logit_bias: 2049 entries"),
    ("2049 allowed ids", text_request("Hi", S(allowed_token_ids=list(range(2049)))),
     "sampling.allowed_token_ids: 2049 entries"),
    ("two prompts", R(text="Hi", token_ids=[1, 2]), "prompt"),
    ("empty text", R(text=""), "text"),
    ("token id out of vocab", R(token_ids=[100, 49152]), "token_ids"),
    ("negative token id", R(token_ids=[-5]), "token_ids"),
    ("prompt too long", R(token_ids=[100] * 256), "token_ids"),
    ("text too long", R(text="hello " * 300), "text"),
    ("empty chat role", R(messages=[M(role="", content="hi")]), "messages[0].role"),
    ("request_id too long", R(request_id="x" * 300, text="Hi"), "request_id"),
]


def test_each_invalid_input_is_refused_naming_its_field(server):
    server.wait_idle()  # every request before this test has ended: none can be admitted now
    admitted = server.scheduled_prompt_tokens()
    for case, request, field in CASES:
        with pytest.raises(grpc.RpcError) as e:
            list(server.stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert e.value.details().startswith(field), (case, e.value.details())
    assert server.scheduled_prompt_tokens() == admitted, "an invalid request reached the engine"
    # Still serving, with the engine intact.
    _, _, last, _ = collect(server.stub.Generate(text_request("Hi", greedy(3)), timeout=60))
    assert last.finish_reason == "length" and last.usage.completion_tokens == 3
    assert server.scheduled_prompt_tokens() > admitted  # the count sees a request that ran
    server.wait_idle()


def test_a_request_that_cannot_fit_names_both_numbers(server):
    prompt = [100] * 10
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(R(token_ids=prompt, sampling=S(max_tokens=5000)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "sampling.max_tokens: 5000 with a 10-token prompt needs 5010 tokens, more than "
        "max_model_len (256): ask for at most 246")


def test_unset_fields_take_the_documented_defaults(server):
    # max_tokens unset = 16 (not 0, which would be refused); temperature unset = the model's
    # default (GetModelInfo.sampling_defaults, test_first_answer.py).
    _, _, last, _ = collect(server.stub.Generate(
        text_request("Hi", S(ignore_eos=True)), timeout=60))
    assert last.usage.completion_tokens == 16 and last.finish_reason == "length"
