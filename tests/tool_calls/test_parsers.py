"""The tool-call parsers on replies as the models write them: whole, and streamed split at every
point (a tag, a name, an argument cut anywhere), which must give the same text and calls."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.core.tool_calls import (
    FORMATS,
    Deltas,
    ToolCallStream,
    choose_format,
    format_for_template,
    parse,
)

SMOLLM2, HERMES, LLAMA = FORMATS["smollm2"], FORMATS["hermes"], FORMATS["llama3_json"]
WEATHER = {"city": "Paris", "unit": "celsius"}

# (format, reply, expected content, expected [(name, arguments)])
CASES = [
    (SMOLLM2, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
              '"celsius"}}]</tool_call>', None, [("get_weather", WEATHER)]),
    (SMOLLM2, '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "mul", '
              '"arguments": {"a": 3, "b": [4, {"x": "}]"}]}}]</tool_call>', None,
     [("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": [4, {"x": "}]"}]})]),
    (SMOLLM2, 'Sure. <tool_call>[{"arguments": {"q": "say \\"hi\\" <b>"}, "name": "search"}]'
              '</tool_call>', "Sure. ", [("search", {"q": 'say "hi" <b>'})]),
    (SMOLLM2, "The answer is 2 < 3 and <tool> is not a tag; <tool_cal is cut.",
     "The answer is 2 < 3 and <tool> is not a tag; <tool_cal is cut.", []),
    (SMOLLM2, "<tool_call>I cannot call anything here.</tool_call> Sorry.",
     "<tool_call>I cannot call anything here.</tool_call> Sorry.", []),
    (SMOLLM2, '<tool_call>[{"name": "ping", "arguments": {}}]', None, [("ping", {})]),
    (SMOLLM2, '<tool_call>[{"name": "ping"}]</tool_call>', None, [("ping", {})]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
             '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"zone": "Europe/Paris"}}\n</tool_call>', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "Europe/Paris"})]),
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": "{\\"id\\": 7}"}\n'
             '</tool_call>', "Let me check.\n", [("lookup", {"id": 7})]),
    (HERMES, 'Prix: 5 €, 東京 <tool_call>{"name": "convert", "arguments": {"to": "円"}}'
             '</tool_call> done', "Prix: 5 €, 東京  done", [("convert", {"to": "円"})]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
            '{"y": true}}', None, [("a", {"x": 1}), ("b", {"y": True})]),
    (LLAMA, "  Paris is in France. {\"name\": \"x\"} is JSON.",
     "  Paris is in France. {\"name\": \"x\"} is JSON.", []),
    (LLAMA, "{not json at all}", "{not json at all}", []),
    (HERMES, '<tool_call>{"name": "f", "arguments": "bad \\q escape"}</tool_call>', None,
     [("f", '"bad \\q escape"')]),
]


def _collect(deltas: list[Deltas]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(text, [(name, arguments text)], the order of events) from a stream's deltas."""
    text, calls, order = "", [], []
    for d in deltas:
        text += d.text
        for c in d.calls:
            if c.name is not None:
                assert c.index == len(calls), "calls are announced in order, once"
                assert c.id and c.id.startswith("call_")
                calls.append([c.name, ""])
                order.append(f"name{c.index}")
            else:
                assert c.index < len(calls), "arguments come after their call's name"
                calls[c.index][1] += c.arguments
                order.append(f"args{c.index}")
    return text, [(n, a) for n, a in calls], order


def _arguments(text: str):
    """JSON arguments as their value; anything else (a bad escape kept) as written."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _streamed(fmt, pieces: list[str]):
    stream = ToolCallStream(fmt)
    return _collect([*(stream.feed(p) for p in pieces), stream.finish()])


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_a_whole_reply(fmt, reply, content, calls):
    parsed = parse(fmt, reply)
    assert parsed.content == content
    assert [(c.name, _arguments(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_every_split_of_a_stream(fmt, reply, content, calls):
    whole_text, whole_calls, _ = _streamed(fmt, [reply])
    assert [(n, _arguments(a)) for n, a in whole_calls] == calls
    for i in range(len(reply) + 1):
        assert _streamed(fmt, [reply[:i], reply[i:]])[:2] == (whole_text, whole_calls), i
    by_char = _streamed(fmt, list(reply))
    assert by_char[:2] == (whole_text, whole_calls)
    named_first = reply.find('"name"') < min(reply.find(f'"{k}"') % len(reply)
                                            for k in ("arguments", "parameters"))
    object_arguments = calls and isinstance(calls[0][1], dict) and calls[0][1] \
        and "\"{" not in reply
    if object_arguments and named_first:  # an object streams in parts after the name
        assert by_char[2].count("args0") > 1


def test_a_half_open_tag_is_held_until_known():
    stream = ToolCallStream(SMOLLM2)
    assert stream.feed("Hello <tool_").text == "Hello "
    assert stream.feed("box> there").text == "<tool_box> there"
    named = stream.feed(' <tool_call>[{"name": "f", ')
    assert named.text == " " and [(c.index, c.name, c.arguments) for c in named.calls] == [
        (0, "f", "")]
    assert [c.arguments for c in stream.feed('"arguments": {"k"').calls] == ['{"k"']
    assert stream.feed(': 1}}]</tool_call>').calls[0].arguments == ": 1}"
    assert stream.finish().text == ""


def test_prose_inside_a_tag_is_released_without_waiting_for_its_end():
    stream = ToolCallStream(HERMES)
    assert stream.feed("<tool_call>").text == ""
    assert stream.feed(" well, no").text == "<tool_call> well, no"


def test_the_format_comes_from_the_chat_template(default_tokenizer):
    assert format_for_template(default_tokenizer.chat_template) is SMOLLM2
    qwen = "{%- if tools %}...<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>{%- endif %}"
    assert format_for_template(qwen) is HERMES
    llama = "<|start_header_id|>ipython<|end_header_id|>{% if tools %}{{ tools }}{% endif %}"
    assert format_for_template(llama) is LLAMA
    assert format_for_template("{{ messages }}") is None
    assert choose_format("none", default_tokenizer.chat_template) is None
    assert choose_format("hermes", "{{ messages }}") is HERMES
    with pytest.raises(ValueError, match="'mistral' is not one of smollm2, hermes"):
        choose_format("mistral", None)
