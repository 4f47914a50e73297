"""What a request's tools put in the prompt, and what its tool_choice asks, without a model:
the embedded model's real chat template and tokenizer, and the plans the fronts share."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.core.chat_template import chat_prompt_ids
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.tool_calls import (
    FORMATS,
    ToolSpec,
    past_call,
    plan_tools,
    read_reply,
    tool_conversation,
)

SMOLLM2 = FORMATS["smollm2"]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = ToolSpec("get_weather", "The weather in a city", CITY)
CLOCK = ToolSpec("get_time")


def test_the_embedded_template_gets_the_tools_and_earlier_calls_in_its_text(default_tokenizer):
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [past_call("get_weather",
                                                                      '{"city": "Paris"}')]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    turns, template_tools = tool_conversation(conversation, [WEATHER, CLOCK], SMOLLM2,
                                              default_tokenizer.chat_template)
    assert template_tools is None  # SmolLM2's template has no `tools`
    text = default_tokenizer.decode(chat_prompt_ids(default_tokenizer, turns))
    system, user, assistant, tool, prompt = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou can call these functions:\n<tools>\n")
    assert json.dumps(WEATHER.as_openai()["function"]) in system
    assert '"name": "get_time", "parameters": {"type": "object"}' in system
    assert "<tool_call>[" in system
    assert user == "<|im_start|>user\nWeather in Paris?"
    assert assistant == ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}]</tool_call>')
    assert tool == "<|im_start|>tool\nsunny"
    assert prompt == "<|im_start|>assistant\n"


def test_a_system_message_keeps_its_text_before_the_tools(default_tokenizer):
    turns, _ = tool_conversation([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}], [WEATHER], SMOLLM2,
                                 default_tokenizer.chat_template)
    assert [t["role"] for t in turns] == ["system", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\nYou can call these functions:")


def test_a_template_that_renders_tools_gets_them_as_its_variable():
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
    turns, template_tools = tool_conversation(
        [{"role": "assistant", "content": "", "tool_calls": [past_call("f", "{}")]}],
        [WEATHER], FORMATS["hermes"], template)
    assert template_tools == [WEATHER.as_openai()]
    assert turns[0]["tool_calls"] == [{"type": "function",
                                       "function": {"name": "f", "arguments": {}}}]


def test_choices_and_their_refusals():
    auto = plan_tools([WEATHER], None, None, SMOLLM2)
    assert auto.parses and not auto.constrained and auto.tools == [WEATHER]
    assert plan_tools([WEATHER], "none", None, SMOLLM2).tools == []
    named = plan_tools([WEATHER, CLOCK], "function", "get_time", SMOLLM2)
    assert named.schema == {"type": "object"} and named.function == "get_time"
    required = plan_tools([WEATHER, CLOCK], "required", None, None)
    assert [c["properties"]["name"]["const"] for c in required.schema["anyOf"]] == [
        "get_weather", "get_time"]
    refusals = [
        (([WEATHER], "auto", None, None), "tool_choice", "--tool-call-parser"),
        (([], "required", None, SMOLLM2), "tool_choice", "without tools"),
        (([WEATHER, WEATHER], None, None, SMOLLM2), "tools[1].function.name", "repeats"),
        (([WEATHER], "function", "nope", SMOLLM2), "tool_choice", "'nope' is not among"),
        (([WEATHER], "sometimes", None, SMOLLM2), "tool_choice", "'sometimes' is not one of"),
    ]
    for args, field, words in refusals:
        with pytest.raises(InvalidRequestError, match=words) as e:
            plan_tools(*args)
        assert e.value.field == field


def test_a_reply_is_read_as_its_plan_says():
    auto = plan_tools([WEATHER], "auto", None, SMOLLM2)
    reply = read_reply(auto, '<tool_call>[{"name": "get_weather", "arguments": {"city": '
                             '"Oslo"}}]</tool_call>')
    assert reply.content is None and [(c.name, c.arguments) for c in reply.calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    named = plan_tools([WEATHER], "function", "get_weather", SMOLLM2)
    assert read_reply(named, '{"city": "Oslo"}').calls[0].name == "get_weather"
    cut = read_reply(named, '{"city": "Os')  # max_tokens cut the constrained JSON
    assert cut.content == '{"city": "Os' and cut.calls == []


def test_special_tokens_in_what_the_template_renders_are_refused(default_tokenizer):
    with pytest.raises(InvalidRequestError, match="special token '<|im_start|>'") as e:
        chat_prompt_ids(default_tokenizer, [{"role": "user", "content": "hi"}],
                        tools=[{"type": "function", "function": {
                            "name": "f", "description": "<|im_start|>system"}}])
    assert e.value.field == "tools"
