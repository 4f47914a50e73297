"""`strict: true` tools and `parallel_tool_calls: false` under tool_choice "auto", through the
`openai` SDK (chat and Responses) and Generate, on the shared session server.

The conversation shows the model one earlier turn that called the tool twice, for two cities; asked
about two more, the small default model calls it again, greedily with both cities and the right
arguments, and sampled (temperature 1) sometimes with a made-up tool name or argument: what a
strict tool's grammar must rule out. parallel_tool_calls false holds it to the first call.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import jsonschema
import openai
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import collect, greedy
from tests.client_api.test_openai_sdk import MODEL, client  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


def _weather(strict: bool) -> dict:
    return {"type": "function",
            "function": {"name": "get_weather", "parameters": CITY, "strict": strict}}


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


TWO_CITIES = [  # 200 prompt tokens: a call pair fits the server's 256
    {"role": "user", "content": "Weather in Rome and in Oslo?"},
    {"role": "assistant", "tool_calls": [_call(1, "Rome"), _call(2, "Oslo")]},
    {"role": "user", "content": "Weather in Paris and in London?"},
]
SEEDS = range(8)
MAX_TOKENS = 50


def _fits(call) -> bool:
    if call.function.name != "get_weather":
        return False
    try:
        jsonschema.validate(json.loads(call.function.arguments), CITY)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_a_strict_tool_under_auto_gets_only_calls_that_fit(client):  # noqa: F811
    def sampled(strict_seed: tuple[bool, int]):
        strict, seed = strict_seed
        return client.chat.completions.create(
            model=MODEL, messages=TWO_CITIES, tools=[_weather(strict)], max_tokens=MAX_TOKENS,
            temperature=1.0, seed=seed).choices[0]

    # All at once: the engine batches them (a seed decides each one's sampling).
    with concurrent.futures.ThreadPoolExecutor(2 * len(SEEDS)) as pool:
        replies = list(pool.map(sampled, [(s, seed) for s in (True, False) for seed in SEEDS]))
    strict, loose = replies[:len(SEEDS)], replies[len(SEEDS):]
    calls = [c for choice in strict for c in choice.message.tool_calls or ()]
    assert calls and all(_fits(c) for c in calls), [(c.function.name, c.function.arguments)
                                                   for c in calls]
    for choice in strict:  # no broken call left in the text, and the reason says which
        assert "<tool_call>" not in (choice.message.content or "")
        assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else "stop")
    # The same seeds without strict: the model's own calls do not all fit (the test's point).
    assert not all(_fits(c) for choice in loose for c in choice.message.tool_calls or ())

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=TWO_CITIES, tools=[_weather(True)], max_tokens=MAX_TOKENS,
        temperature=0, stream=True))
    arguments: dict[int, str] = {}
    for d in (d for c in chunks for d in c.choices[0].delta.tool_calls or ()):
        arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    assert [json.loads(a) for a in arguments.values()] == [{"city": "Paris"}, {"city": "London"}]


def test_a_strict_tool_still_lets_the_model_answer_in_text(client):  # noqa: F811
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[_weather(True)], max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")


def test_parallel_tool_calls_false_makes_one_call_chat_and_responses(client):  # noqa: F811
    items = [{"role": "user", "content": TWO_CITIES[0]["content"]},
             *({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"]} for c in TWO_CITIES[1]["tool_calls"]),
             {"role": "user", "content": TWO_CITIES[2]["content"]}]
    function = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}

    def chat(**fields):
        return client.chat.completions.create(model=MODEL, messages=TWO_CITIES,
                                              tools=[_weather(False)], max_tokens=MAX_TOKENS,
                                              temperature=0, **fields).choices[0]

    def responses(stream: bool):
        kwargs = dict(model=MODEL, input=items, tools=[function], max_output_tokens=MAX_TOKENS,
                      temperature=0, parallel_tool_calls=False)
        if stream:
            return list(client.responses.create(stream=True, **kwargs))[-1].response
        return client.responses.create(**kwargs)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # batched, as above
        both, one = pool.submit(chat), pool.submit(chat, parallel_tool_calls=False)
        whole, streamed = pool.submit(responses, False), pool.submit(responses, True)
    # The model's own choice: two calls; with parallel_tool_calls false, the first alone.
    assert [json.loads(c.function.arguments) for c in both.result().message.tool_calls] == [
        {"city": "Paris"}, {"city": "London"}]
    assert [json.loads(c.function.arguments) for c in one.result().message.tool_calls] == [
        {"city": "Paris"}]
    assert one.result().finish_reason == "tool_calls"
    for reply in (whole.result(), streamed.result()):
        assert reply.parallel_tool_calls is False
        assert [(o.type, json.loads(o.arguments)) for o in reply.output] == [
            ("function_call", {"city": "Paris"})]


def test_generate_takes_strict_and_parallel_tool_calls(server):
    messages = [generate_pb2.ChatMessage(role=m["role"], content=m.get("content") or "")
                for m in TWO_CITIES]
    for c in TWO_CITIES[1]["tool_calls"]:
        messages[1].tool_calls.add(id=c["id"], name="get_weather",
                                   arguments=c["function"]["arguments"])
    tool = generate_pb2.Tool(name="get_weather", parameters=json.dumps(CITY), strict=True)
    request = generate_pb2.GenerateRequest(messages=messages, tools=[tool],
                                           parallel_tool_calls=False,
                                           sampling=greedy(MAX_TOKENS, ignore_eos=False))
    _, text, last, _ = collect(server.stub.Generate(request, timeout=300))
    assert [(c.name, json.loads(c.arguments)) for c in last.tool_calls] == [
        ("get_weather", {"city": "Paris"})], text
    assert text.startswith("<tool_call>[") and text.endswith("</tool_call>"), text


BAD = {"type": "integer", "minimum": 9, "maximum": 1}


def test_tools_the_grammar_cannot_hold_are_refused_naming_the_field(server, client):  # noqa: F811
    hi = [{"role": "user", "content": "hi"}]
    bad = {"type": "function", "function": {"name": "f", "parameters": BAD, "strict": True}}
    cases = [
        (dict(messages=hi, tools=[_weather(True), bad]), "tools[1].function.parameters"),
        (dict(messages=hi, tools=[_weather(True)], response_format={"type": "json_object"}),
         "response_format"),
        (dict(messages=hi, tools=[_weather(False)], parallel_tool_calls=False,
              response_format={"type": "json_object"}), "response_format"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=4, **fields)
        assert e.value.body["param"] == param, e.value.body
    function = {"type": "function", "name": "f", "parameters": BAD, "strict": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", tools=[function])
    assert e.value.body["param"] == "tools[0].parameters", e.value.body
    tool = generate_pb2.Tool(name="f", parameters=json.dumps(BAD), strict=True)
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content="hi")], tools=[tool])
    with pytest.raises(grpc.RpcError) as g:
        collect(server.stub.Generate(request, timeout=60))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert g.value.details().startswith("tools[0].parameters: does not compile"), \
        g.value.details()
