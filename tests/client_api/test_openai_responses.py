"""POST /v1/responses through the `openai` SDK's client.responses, on the shared session server:
the chat path's tokens (the same greedy reply as chat completions), typed stream events,
previous_response_id, function tools, text.format, and refusals as OpenAI error objects."""

from __future__ import annotations

import json

import openai
import pytest

from scheduler_svc.core.chat_template import chat_prompt_ids
from tests.client_api.test_openai_sdk import MODEL, client  # noqa: F401 (fixture)
from tests.client_api.test_openai_tools import CITY, FEW_SHOT, MAX_TOKENS

pytestmark = pytest.mark.slow

INSTRUCTIONS = "Answer briefly."
QUESTION = "Name three colours."
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": CITY}


def _few_shot_items() -> list[dict]:
    """FEW_SHOT as Responses input items: the earlier call and its output are items."""
    items: list[dict] = []
    for m in FEW_SHOT:
        if m.get("tool_calls"):
            call = m["tool_calls"][0]
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def test_text_whole_streamed_and_continued(client, default_tokenizer):  # noqa: F811
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                    max_output_tokens=8, temperature=0)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == chat.choices[0].message.content
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert (first.usage.input_tokens, first.usage.output_tokens) == (
        chat.usage.prompt_tokens, 8)
    assert first.usage.total_tokens == first.usage.input_tokens + 8

    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS,
                                          input=QUESTION, max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == first.output_text
    assert events[-1].response.output_text == first.output_text

    # The next turn: the stored conversation, then the new input; instructions not carried.
    follow = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="One more?", max_output_tokens=2, temperature=0)
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "One more?"}]
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == len(chat_prompt_ids(default_tokenizer, conversation))


def test_a_function_call_whole_and_streamed(client):  # noqa: F811
    reply = client.responses.create(model=MODEL, input=_few_shot_items(), tools=[FUNCTION],
                                    max_output_tokens=MAX_TOKENS, temperature=0, store=False)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model=MODEL, input=_few_shot_items(),
                                          tools=[FUNCTION], max_output_tokens=MAX_TOKENS,
                                          temperature=0, stream=True, store=False))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added if i.type == "function_call"] == [
        ("function_call", "get_weather")]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": "Paris"}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"}
    # store: false kept nothing to continue from.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=reply.id, input="And?")
    assert e.value.body["param"] == "previous_response_id"


def test_text_format_json_schema(client):  # noqa: F811
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.responses.create(
        model=MODEL, input="Is the sky blue?", max_output_tokens=12, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert reply.status == "completed"
    assert set(json.loads(reply.output_text)) == {"ok"}


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": [{"content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_refusals_name_the_field(client, fields, param):  # noqa: F811
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
