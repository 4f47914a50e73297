"""Options of the stream itself on a real server: the prompt echoed, usage on every message, the
matched stop named, and request ids that clash with a request of n sequences."""

from __future__ import annotations

import grpc
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import collect, greedy

pytestmark = pytest.mark.slow

R = generate_pb2.GenerateRequest
PROMPT = "The capital of France is"


def test_echo_returns_the_prompt_in_the_first_message_only(server, default_tokenizer):
    ids = default_tokenizer(PROMPT).input_ids
    messages = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(6, echo=True)),
                                         timeout=60))
    assert list(messages[0].prompt_token_ids) == ids
    assert messages[0].prompt_text == PROMPT
    assert all(not m.prompt_token_ids and not m.HasField("prompt_text") for m in messages[1:])
    plain = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(6)), timeout=60))
    assert all(not m.prompt_token_ids and not m.HasField("prompt_text") for m in plain)
    # The output is what it is without echo.
    assert collect(iter(messages))[:2] == collect(iter(plain))[:2]


def test_echo_gives_the_prompt_as_run(server, default_tokenizer):
    ids = default_tokenizer("Once upon a time, in a land far away, there lived a king",
                            add_special_tokens=False).input_ids
    first = next(iter(server.stub.Generate(R(token_ids=ids, sampling=greedy(
        2, echo=True, truncate_prompt_tokens=5)), timeout=60)))
    assert list(first.prompt_token_ids) == ids[-5:]
    assert first.prompt_text == default_tokenizer.decode(ids[-5:])
    # A chat prompt comes back rendered by the template, its special tokens included.
    chat = [generate_pb2.ChatMessage(role="user", content="What is 2+2?")]
    first = next(iter(server.stub.Generate(R(messages=chat, sampling=greedy(2, echo=True)),
                                           timeout=60)))
    rendered = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert first.prompt_text == rendered
    assert list(first.prompt_token_ids) == default_tokenizer(
        rendered, add_special_tokens=False).input_ids


def test_echo_with_n_sequences_comes_once(server, default_tokenizer):
    messages = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(4, n=3, echo=True)),
                                         timeout=60))
    echoed = [m for m in messages if m.prompt_token_ids]
    assert len(echoed) == 1 and echoed[0] is messages[0]
    assert list(echoed[0].prompt_token_ids) == default_tokenizer(PROMPT).input_ids
    server.wait_idle()


def _check_running_usage(messages, prompt_tokens: int) -> None:
    """Every message's usage counts the tokens of every message so far."""
    received = 0
    for m in messages:
        received += len(m.token_ids)
        assert m.HasField("usage"), m
        assert (m.usage.prompt_tokens, m.usage.completion_tokens) == (prompt_tokens, received)
        assert m.usage.total_tokens == prompt_tokens + received
        assert m.usage.cached_tokens == messages[-1].usage.cached_tokens


def test_continuous_usage_counts_the_tokens_received_so_far(server, default_tokenizer):
    prompt_len = len(default_tokenizer(PROMPT).input_ids)
    messages = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(
        12, continuous_usage=True)), timeout=60))
    assert len(messages) > 2, "the reply should stream"
    _check_running_usage(messages, prompt_len)
    assert messages[-1].usage.completion_tokens == 12
    # The same prompt again: its cached prefix shows on every message, not only the last.
    long = PROMPT + " a city of museums, cafés and bridges over the Seine, which is known for"
    list(server.stub.Generate(R(text=long, sampling=greedy(2)), timeout=60))
    again = list(server.stub.Generate(R(text=long, sampling=greedy(
        6, continuous_usage=True)), timeout=60))
    assert again[0].usage.cached_tokens >= 16
    _check_running_usage(again, len(default_tokenizer(long).input_ids))
    # Without it, usage is on the last message only.
    plain = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(12)), timeout=60))
    assert [m.HasField("usage") for m in plain] == [False] * (len(plain) - 1) + [True]


def test_continuous_usage_with_n_sequences_is_the_whole_requests(server, default_tokenizer):
    prompt_len = len(default_tokenizer(PROMPT).input_ids)
    messages = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(
        8, n=3, continuous_usage=True)), timeout=60))
    _check_running_usage(messages, prompt_len)
    assert messages[-1].usage.completion_tokens == 24
    # Without it, the stream's last message carries the whole request's usage, and only it.
    plain = list(server.stub.Generate(R(text=PROMPT, sampling=greedy(8, n=3)), timeout=60))
    assert [m.HasField("usage") for m in plain] == [False] * (len(plain) - 1) + [True]
    assert plain[-1].usage.completion_tokens == 24
    server.wait_idle()


def test_an_aborted_stream_is_accounted_for(server):
    call = server.stub.Generate(R(request_id="usage-abort", text=PROMPT, sampling=greedy(
        200, n=2, continuous_usage=True)), timeout=120)
    messages = [next(call), next(call)]
    server.stub.Abort(generate_pb2.AbortRequest(request_ids=["usage-abort"]), timeout=10)
    messages += list(call)
    assert {m.index: m.finish_reason for m in messages if m.HasField("finish_reason")} == {
        0: "abort", 1: "abort"}
    received = sum(len(m.token_ids) for m in messages)
    assert 0 < received < 400
    assert messages[-1].usage.completion_tokens == received
    server.wait_idle()


def test_the_last_message_names_the_matched_stop(server, default_tokenizer):
    eos = default_tokenizer.eos_token_id
    to_eos = {eos: 100.0}  # greedy then samples EOS at once
    ids, _, last, _ = collect(server.stub.Generate(R(text=PROMPT, sampling=greedy(
        8, ignore_eos=False, logit_bias=to_eos)), timeout=60))
    # EOS: "stop", and neither stop field (as generate.proto documents).
    assert ids == [eos] and last.finish_reason == "stop"
    assert last.WhichOneof("stop_reason") is None
    # A stop token id (EOS itself, listed) and a stop string are named, in each of n sequences.
    for sampling, field, value in [
            (greedy(8, stop_token_ids=[eos], logit_bias=to_eos, n=2), "stop_token_id", eos),
            (greedy(24, stop=["."], ignore_eos=False, n=2), "stop_string", ".")]:
        messages = list(server.stub.Generate(R(text=PROMPT, sampling=sampling), timeout=60))
        finals = [m for m in messages if m.HasField("finish_reason")]
        assert sorted(m.index for m in finals) == [0, 1]
        for m in finals:
            assert m.finish_reason == "stop" and m.WhichOneof("stop_reason") == field
            assert getattr(m, field) == value
        assert messages[-1].HasField("usage")
    server.wait_idle()


def _refused_as_in_use(server, request_id: str, sampling: generate_pb2.SamplingParams) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(R(request_id=request_id, text="Hi", sampling=sampling),
                                  timeout=30))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value
    assert repr(request_id) in e.value.details()


@pytest.mark.parametrize("first_n", [3, 1])
def test_an_id_in_use_by_n_sequences_or_one_clashes_with_both(server, first_n):
    """The engine runs an n > 1 request "x" as "x#0".."x#n-1": a plain "x" or another n > 1 "x"
    must still be refused while it runs, and either kind while a plain "x" runs."""
    call = server.stub.Generate(R(request_id="clash", text=PROMPT, sampling=greedy(
        200, n=first_n)), timeout=120)
    next(call)
    _refused_as_in_use(server, "clash", greedy(2))
    _refused_as_in_use(server, "clash", greedy(2, n=2))
    server.stub.Abort(generate_pb2.AbortRequest(request_ids=["clash"]), timeout=10)
    reasons = {m.index: m.finish_reason for m in call if m.HasField("finish_reason")}
    assert reasons == {i: "abort" for i in range(first_n)}, "the refusals must not end it"
    server.wait_idle()
    # Once it has ended, the id is free again, for either kind.
    for n in (1, 2):
        ids, _, last, _ = collect(server.stub.Generate(R(request_id="clash", text="Hi",
                                                         sampling=greedy(2, n=n)), timeout=60))
        assert last.finish_reason == "length" and len(ids) == 2 * n
    server.wait_idle()
