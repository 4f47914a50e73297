"""The grammar tool_choice "auto" holds a reply to when a tool is strict or parallel_tool_calls is
false, compiled for the embedded model's real tokenizer, fed real replies in each format's
syntax; and the refusals of schemas it cannot hold, naming the tool's field."""

from __future__ import annotations

import pytest

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.structured_output import GrammarCompiler
from scheduler_svc.core.tool_calls import FORMATS, ToolSpec, plan_tools, tool_constraint

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = ToolSpec("get_weather", "The weather in a city", CITY, strict=True)
CLOCK = ToolSpec("get_time")  # not strict: any object as arguments
PARIS = '"name": "get_weather", "arguments": {"city": "Paris"}'
TOWN = '"name": "get_weather", "arguments": {"town": "Paris"}'  # not the strict schema
TIME = '"name": "get_time", "arguments": {"zone": "UTC"}'
L_PARIS = PARIS.replace("arguments", "parameters")

# (format, the replies it allows with parallel calls, with one call at most, and neither)
CASES = {
    "smollm2": (
        ["The sky is blue.", f"<tool_call>[{{{PARIS}}}]</tool_call>",
         f"Let me see. <tool_call>[{{{PARIS}}}]</tool_call> Done.",
         f"<tool_call>[{{{PARIS}}}]</tool_call> Done.",
         f"<tool_call>[{{{TIME}}}, {{{PARIS}}}]</tool_call>",
         f"<tool_call>[{{{TIME}}}]</tool_call><tool_call>[{{{PARIS}}}]</tool_call>"],
        ["The sky is blue.", f"<tool_call>[{{{PARIS}}}]</tool_call>"],
        [f"<tool_call>[{{{TOWN}}}]</tool_call>", '<tool_call>[{"name": "nope", "arguments": '
         '{}}]</tool_call>', f"<tool_call>[{{{PARIS}}}, {{{TIME}}}]", "<tool_call>[]</tool_call>"]),
    "hermes": (
        [f"<tool_call>\n{{{PARIS}}}\n</tool_call>",
         f"<tool_call>{{{TIME}}}</tool_call>\n<tool_call>{{{PARIS}}}</tool_call>"],
        [f"<tool_call>\n{{{PARIS}}}\n</tool_call>", "Hello <tool_call"],
        [f"<tool_call>{{{TOWN}}}</tool_call>", f"<tool_call>[{{{PARIS}}}]</tool_call>"]),
    "llama3_json": (
        [f"{{{L_PARIS}}}", f"{{{L_PARIS}}}; {{{TIME.replace('arguments', 'parameters')}}}",
         "Paris is sunny {today}."],
        [f"{{{L_PARIS}}}", "Paris is sunny {today}."],
        [f"{{{PARIS}}}", "{not a call", f"{{{L_PARIS}}} and more"]),
}


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer, len(default_tokenizer))


def _allows(compiler, grammar_text: str, reply: str) -> bool:
    import xgrammar as xgr

    from scheduler_svc.core.structured_output import Constraint

    matcher = xgr.GrammarMatcher(compiler.compile(Constraint("grammar", grammar_text)))
    return matcher.accept_string(reply) and matcher.is_completed()


@pytest.mark.parametrize("fmt", CASES)
def test_strict_auto_allows_text_and_fitting_calls_only(compiler, fmt):
    parallel_ok, single_ok, neither = CASES[fmt]
    for parallel, allowed in ((True, parallel_ok), (False, single_ok)):
        plan = plan_tools([WEATHER, CLOCK], None, None, FORMATS[fmt], parallel=parallel)
        assert plan.parses and plan.tagged
        kind, text = tool_constraint(plan)
        assert kind == "grammar"
        for reply in allowed:
            assert _allows(compiler, text, reply), (fmt, parallel, reply)
        refused = neither + [r for r in parallel_ok if r not in single_ok] if not parallel \
            else neither
        for reply in refused:
            assert not _allows(compiler, text, reply), (fmt, parallel, reply)


def test_what_is_constrained_under_each_choice():
    smollm2 = FORMATS["smollm2"]
    free = plan_tools([ToolSpec("get_weather", None, CITY), CLOCK], "auto", None, smollm2)
    assert not free.tagged and tool_constraint(free) is None  # no strict tool: the model's own
    single = plan_tools([CLOCK], "auto", None, smollm2, parallel=False)
    assert single.tagged and tool_constraint(single)[0] == "grammar"
    assert plan_tools([WEATHER], "none", None, smollm2).tools == []
    named = plan_tools([WEATHER, CLOCK], "function", "get_weather", smollm2)
    assert tool_constraint(named) == ("json_schema", '{"type": "object", "properties": '
                                      '{"city": {"type": "string"}}, "required": ["city"], '
                                      '"additionalProperties": false}')


BAD_SCHEMAS = [
    ({"type": "bogus"}, "does not compile"),
    ({"not": {}}, "admits no value"),
    ({"items": {"items": {}}} | {"properties": {"a": {"items": {"items": {"items": {}}}}}},
     None),  # deep but fine: compiles
    (_deep := {"type": "object"}, None),
]
for _ in range(70):  # deeper than the 64 levels any json_schema constraint may nest
    _deep = {"type": "array", "items": _deep}
BAD_SCHEMAS.append((_deep, "the limit is 64"))


@pytest.mark.parametrize("schema,words", BAD_SCHEMAS)
def test_a_schema_the_grammar_cannot_hold_is_refused_naming_the_tool(schema, words):
    tools = [CLOCK, ToolSpec("f", None, schema, strict=True)]
    cases = [(plan_tools(tools, None, None, FORMATS["hermes"]), "tools[1].function.parameters"),
             (plan_tools(tools, "required", None, None, "tools[{}]"), "tools[1].parameters"),
             (plan_tools(tools, "function", "f", None, "tools[{}]"), "tools[1].parameters")]
    for plan, field in cases:
        if words is None:
            assert tool_constraint(plan) is not None
            continue
        with pytest.raises(InvalidRequestError, match=words) as e:
            tool_constraint(plan)
        assert e.value.field == field
    # Not strict under auto: the schema is only shown to the model, never compiled.
    loose = plan_tools([ToolSpec("f", None, schema)], None, None, FORMATS["hermes"])
    assert tool_constraint(loose) is None


def test_too_many_strict_tools_for_one_grammar_are_refused_naming_tools():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    tools = [ToolSpec(f"f{i}", None, big, strict=True) for i in range(40)]
    with pytest.raises(InvalidRequestError, match="grammar is .* characters long") as e:
        tool_constraint(plan_tools(tools, None, None, FORMATS["hermes"]))
    assert e.value.field == "tools"
