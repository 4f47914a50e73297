"""Tool calls under tool_choice "auto" (tools sent without tool_choice, as agent frameworks do)
through the `openai` SDK and Generate, on the shared session server.

The small default model seldom calls a tool on its own; shown one earlier call and its result
(a few-shot conversation, which also carries an assistant's tool_calls and a "tool" turn through
the template) it calls again, greedily the same way every time.
"""

from __future__ import annotations

import json

import grpc
import pytest
from batchwire.v1 import generate_pb2

from scheduler_svc.core.chat_template import chat_prompt_ids
from scheduler_svc.core.tool_calls import FORMATS, ToolSpec, past_call, tool_conversation
from tests.client_api.server_process import collect, greedy
from tests.client_api.test_openai_sdk import MODEL, client  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The weather in a city",
                                            "parameters": CITY}}
EARLIER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
FEW_SHOT = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "tool_calls": [EARLIER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in Rome."},
    {"role": "user", "content": "Weather in Paris?"},
]
MAX_TOKENS = 24


def _expected_prompt_tokens(tokenizer) -> int:
    conversation = [{k: v for k, v in m.items() if k != "tool_calls"} for m in FEW_SHOT]
    conversation[1] = {"role": "assistant", "content": "",
                       "tool_calls": [past_call("get_weather", '{"city": "Rome"}')]}
    turns, _ = tool_conversation(conversation, [ToolSpec("get_weather", "The weather in a city",
                                                         CITY)],
                                 FORMATS["smollm2"], tokenizer.chat_template)
    return len(chat_prompt_ids(tokenizer, turns))


def test_auto_calls_a_tool_whole_and_streamed(client, default_tokenizer):  # noqa: F811
    reply = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=[WEATHER],
                                           max_tokens=MAX_TOKENS, temperature=0)
    # The earlier call and the tool's result went through the template in SmolLM2's syntax.
    assert reply.usage.prompt_tokens == _expected_prompt_tokens(default_tokenizer)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=[WEATHER], max_tokens=MAX_TOKENS, temperature=0,
        stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    first, *fragments = deltas
    assert first.index == 0 and first.id.startswith("call_")
    assert first.function.name == "get_weather"
    assert fragments and all(d.index == 0 and d.id is None and d.function.name is None
                             for d in fragments)  # the name first, then argument fragments
    arguments = (first.function.arguments or "") + "".join(d.function.arguments
                                                           for d in fragments)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()  # no tag text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_generate_carries_the_parsed_calls(server):
    messages = [generate_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                         tool_call_id=m.get("tool_call_id", ""))
                for m in FEW_SHOT]
    messages[1].tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
    tool = generate_pb2.Tool(name="get_weather", description="The weather in a city",
                             parameters=json.dumps(CITY))
    for choice, function in ((generate_pb2.TOOL_CHOICE_UNSPECIFIED, ""),
                             (generate_pb2.TOOL_CHOICE_FUNCTION, "get_weather")):
        request = generate_pb2.GenerateRequest(
            messages=messages, tools=[tool], tool_choice=choice, tool_choice_function=function,
            sampling=greedy(MAX_TOKENS, ignore_eos=False))
        _, text, last, _ = collect(server.stub.Generate(request, timeout=300))
        (call,) = last.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_"), text
        assert json.loads(call.arguments) == {"city": "Paris"}, text
        if choice == generate_pb2.TOOL_CHOICE_UNSPECIFIED:  # auto: the model's own syntax
            assert text.startswith("<tool_call>"), text
        else:  # constrained to the arguments' JSON
            assert json.loads(text) == {"city": "Paris"}


def test_generate_refuses_bad_tools_naming_the_field(server):
    tool = generate_pb2.Tool(name="f", parameters=json.dumps(CITY))
    hi = [generate_pb2.ChatMessage(role="user", content="hi")]
    cases = [
        ({"tools": [generate_pb2.Tool(name="f", parameters="{not json")]}, "tools[0].parameters"),
        ({"tools": [generate_pb2.Tool(name="f", parameters="[1]")]}, "tools[0].parameters"),
        ({"tools": [tool, tool]}, "tools[1].name"),
        ({"tools": [tool], "tool_choice": generate_pb2.TOOL_CHOICE_FUNCTION,
          "tool_choice_function": "g"}, "tool_choice"),
        ({"tools": [tool], "tool_choice": 99}, "tool_choice"),
        ({"tool_choice": generate_pb2.TOOL_CHOICE_REQUIRED}, "tool_choice"),
        ({"tools": [tool], "tool_choice_function": "f"}, "tool_choice_function"),
        ({"tools": [tool], "tool_choice": generate_pb2.TOOL_CHOICE_REQUIRED,
          "sampling": generate_pb2.SamplingParams(json_object=True)}, "sampling.json_object"),
    ]
    for fields, field in cases:
        request = generate_pb2.GenerateRequest(messages=hi, **fields)
        with pytest.raises(grpc.RpcError) as e:
            collect(server.stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert e.value.details().startswith(f"{field}:"), (fields, e.value.details())
    text = generate_pb2.GenerateRequest(text="hi", tools=[tool])
    with pytest.raises(grpc.RpcError) as e:
        collect(server.stub.Generate(text, timeout=60))
    assert e.value.details().startswith("tools: need a chat prompt"), e.value.details()
