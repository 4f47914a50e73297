"""Constraints on arrival: the Python shape, compilation with the model's tokenizer, the cache,
and the refusals (each naming its field)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc import InvalidRequestError, SamplingParams
from scheduler_svc.core.structured_output import Constraint, GrammarCompiler, RequestGrammar
from scheduler_svc.core.structured_output.compiler import choice_grammar, unpack_row
from scheduler_svc.core.structured_output.constraint import constraint_from_fields
from scheduler_svc.core.structured_output.schema_check import why_unsatisfiable

from .conftest import COLOURS, DATE_REGEX, PERSON_SCHEMA

VOCAB = 49152  # the model's; the bitmask is padded to it


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer, VOCAB)


def refused(field: str, **params) -> str:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**params)
    assert e.value.field == field, e.value
    return e.value.message


def test_each_kind_becomes_one_constraint_and_goes_to_the_worker():
    cases = [
        (dict(json_schema=PERSON_SCHEMA), "json_schema", json.dumps(PERSON_SCHEMA)),
        (dict(json_schema='{"type": "integer"}'), "json_schema", '{"type": "integer"}'),
        (dict(json_object=True), "json_object", ""),
        (dict(regex=DATE_REGEX), "regex", DATE_REGEX),
        (dict(choice=COLOURS), "choice", json.dumps(COLOURS)),
        (dict(grammar='root ::= "a"+'), "grammar", 'root ::= "a"+'),
    ]
    for kwargs, kind, text in cases:
        params = SamplingParams(**kwargs)
        assert params.constraint == Constraint(kind, text)
        msg = params.to_proto(eos_token_ids=[2])
        assert msg.WhichOneof("constraint") == kind
    assert SamplingParams(choice=COLOURS).to_proto([2]).choice.choices == COLOURS
    assert SamplingParams().constraint is None
    assert SamplingParams(json_object=False).constraint is None
    assert SamplingParams().to_proto([2]).WhichOneof("constraint") is None


def test_bad_shapes_are_refused_naming_the_field():
    assert "got regex, choice" in refused("constraint", regex="a", choice=["a"])
    assert "at least one" in refused("choice", choice=[])
    assert "non-empty string" in refused("choice", choice=["a", ""])
    assert "list of strings" in refused("choice", choice="red")
    assert "non-empty string" in refused("regex", regex="")
    assert "non-empty string" in refused("grammar", grammar="")
    assert "not valid JSON" in refused("json_schema", json_schema="{")
    assert "JSON object" in refused("json_schema", json_schema="[1]")
    assert "must be a bool" in refused("json_object", json_object="yes")
    assert "cannot be combined" in refused("min_tokens", regex="a+", min_tokens=2)


@pytest.mark.parametrize(("constraint", "expected"), [
    (Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}'),
     "minimum greater than maximum"),
    (Constraint("json_schema", '{"type": "bogus"}'), "bogus"),
    (Constraint("regex", "(ab"), "parenthesis"),
    (Constraint("grammar", "root ::= "), "EBNF"),
    (Constraint("grammar", 'start ::= "a"'), "root"),
    # Cannot match any text: no first character; a dead end after the first; every branch dead.
    (Constraint("regex", r"[^\s\S]"), "cannot match any text"),
    (Constraint("regex", r"ab[^\d\D]"), "cannot match any text"),
    (Constraint("regex", r"(x|y)[^\w\W]z"), "cannot match any text"),
    (Constraint("grammar", 'root ::= "a" dead\ndead ::= [^\\0-\\U0010FFFF]'),
     "cannot match any text"),
    # Byte 0x04 has no token in this vocabulary: the model cannot write it.
    (Constraint("grammar", 'root ::= "ab" "\\x04"'), "cannot match any text"),

    # JSON schemas that no value satisfies, though xgrammar compiles them.
    (Constraint("json_schema", '{"not": {}}'), "`not` excludes every value"),
    (Constraint("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}'),
     "no type is left"),
    (Constraint("json_schema", '{"type": "string", "enum": [1, 2]}'), "none of the values"),
    (Constraint("json_schema", '{"anyOf": [{"not": true}, {"type": []}]}'),
     "every branch of anyOf"),
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"not": {}}}, '
                               '"required": ["a"]}'), "required property 'a'"),
    (Constraint("json_schema", '{"type": "object", "required": ["b"], '
                               '"additionalProperties": false}'), "additionalProperties"),
])
def test_bad_constraints_are_refused_naming_their_kind(compiler, constraint, expected):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(constraint)
    assert e.value.field == constraint.kind
    assert expected in e.value.message, e.value.message
    assert "/project/" not in e.value.message  # xgrammar's source path is noise to a client


def test_compiled_grammars_are_cached_by_kind_and_text(compiler):
    date = Constraint("regex", DATE_REGEX)
    first = compiler.compile(date)
    assert compiler.compile(Constraint("regex", DATE_REGEX)) is first
    text = json.dumps(["x"])  # a choice list, and as a regex a character class
    assert compiler.compile(Constraint("regex", text)) is not compiler.compile(
        Constraint("choice", text))


def allowed_texts(tokenizer, grammar: RequestGrammar) -> set[str]:
    bitmask = np.empty((1, VOCAB // 32), dtype=np.int32)
    grammar.fill(bitmask, 0)
    return {tokenizer.decode([t]) for t in np.flatnonzero(unpack_row(bitmask[0], VOCAB))}


def test_choice_allows_exactly_its_strings_then_only_eos(compiler, default_tokenizer):
    tricky = ['say "hi"', "back\\slash", "two\nlines", "日本"]
    assert json.loads("[" + choice_grammar(tricky).split("::= ")[1].replace(" | ", ",") + "]") \
        == tricky
    compiled = compiler.compile(Constraint("choice", json.dumps(tricky)))
    for text in tricky:
        grammar = RequestGrammar(compiled, [2])
        for token in default_tokenizer(text, add_special_tokens=False).input_ids:
            assert not grammar.accept(token)
        assert allowed_texts(default_tokenizer, grammar) == {"<|im_end|>"}
        assert grammar.accept(2) and grammar.finished  # EOS terminates it
    grammar = RequestGrammar(compiled, [2])
    assert grammar.accept(default_tokenizer("x").input_ids[0])  # a token it never allowed


def test_a_dead_end_at_run_time_allows_only_eos(default_tokenizer):
    # Past the search budget (256 fills) the admission check cannot see the dead end.
    compiler = GrammarCompiler(default_tokenizer, VOCAB)
    compiled = compiler.compile(Constraint("regex", "a{300}[^\\s\\S]"))
    grammar = RequestGrammar(compiled, [2])
    for _ in range(300):
        assert not grammar.accept(default_tokenizer("a").input_ids[0])
    assert allowed_texts(default_tokenizer, grammar) == {"<|im_end|>"}


def nested_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


@pytest.mark.parametrize(("fields", "kind", "expected"), [
    # Deep nesting overflowed the JSON parser (RecursionError, an INTERNAL error on the wire)
    # or took xgrammar tens of seconds; each is refused before any parser runs.
    ({"json_schema": nested_schema(500)}, "json_schema", "nests 501 levels deep; the limit is 64"),
    ({"json_schema": "[" * 100_000}, "json_schema", "nests 100000 levels deep"),
    ({"json_schema": '{"anyOf": [' * 2000 + "{}" + "]}" * 2000}, "json_schema", "nests 4001"),
    ({"json_schema": json.dumps({"enum": ["x" * 200_000]})}, "json_schema",
     "characters long; the limit is 131072"),
    ({"regex": "(" * 100 + "a" + ")" * 100}, "regex", "nests 100 levels deep"),
    ({"grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500}, "grammar", "nests 500 levels"),
])
def test_constraints_past_the_size_and_depth_limits_are_refused_at_once(fields, kind, expected):
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        constraint_from_fields(**fields)
    assert time.perf_counter() - t0 < 0.5
    assert e.value.field == kind and expected in e.value.message, e.value.message


def test_a_deep_schema_given_as_a_dict_is_refused():
    schema: dict = {}
    inner = schema
    for _ in range(3000):
        inner["items"] = {}
        inner = inner["items"]
    with pytest.raises(InvalidRequestError, match="nests too deep"):
        constraint_from_fields(json_schema=schema)


def test_brackets_inside_strings_and_classes_do_not_count_as_nesting(compiler):
    # 70 literal brackets each: in a JSON string, escaped in a regex, in a character class.
    compiler.compile(constraint_from_fields(json_schema={"enum": ["[" * 70]}))
    compiler.compile(constraint_from_fields(regex=r"\(" * 70 + "a"))
    compiler.compile(constraint_from_fields(regex="[([{]" * 70))
    compiler.compile(constraint_from_fields(json_schema=nested_schema(60)))  # within the limit


_KEYS = st.sampled_from(["type", "not", "allOf", "anyOf", "oneOf", "enum", "const", "required",
                         "properties", "items", "minItems", "additionalProperties", "$ref"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_the_satisfiability_check_never_raises_on_any_json(schema):
    # It runs on every schema xgrammar compiled, whatever odd shapes its keywords have.
    reason = why_unsatisfiable(schema)
    assert reason is None or isinstance(reason, str)


def wide_schema(n: int, salt: str = "") -> dict:
    return {"type": "object", "required": [f"f{salt}{i}" for i in range(n)],
            "properties": {f"f{salt}{i}": {"type": "string" if i % 2 else "integer"}
                           for i in range(n)}}


def test_a_compile_past_the_time_limit_is_refused_and_stays_refused(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, VOCAB, timeout_s=0.02)
    slow = Constraint("json_schema", json.dumps(wide_schema(400)))
    with pytest.raises(InvalidRequestError, match="longer than the limit of 0.02 s to compile"):
        compiler.compile(slow)
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="longer than the limit"):
        compiler.compile(slow)  # at once: it is not compiled again
    assert time.perf_counter() - t0 < 0.01
    compiler.timeout_s = 60
    compiler.compile(Constraint("json_schema", '{"type": "integer"}'))  # others still compile
