"""Constrained generation on the real default model through the offline API: every output follows
its constraint, and unconstrained requests in the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from scheduler_svc import SamplingParams

from .conftest import COLOURS, DATE_REGEX, PERSON_SCHEMA, chat

pytestmark = pytest.mark.slow

PEOPLE = ["a pilot", "a baker", "a nurse", "a judge", "a farmer", "a poet", "a chef", "a coach"]
THINGS = ["a cat", "a car", "a city", "a book", "a tree", "a phone", "a river", "a song"]


def test_json_schema_outputs_parse_and_validate(so_llm):
    prompts = [chat(so_llm.tokenizer, f"Describe {p} as a user record in JSON.") for p in PEOPLE]
    params = SamplingParams(temperature=0, max_tokens=64, json_schema=PERSON_SCHEMA)
    for out in so_llm.generate(prompts, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_json_object_outputs_parse_as_objects(so_llm):
    prompts = [chat(so_llm.tokenizer, f"Give {t} a name and a colour, as a small JSON object.")
               for t in THINGS]
    params = SamplingParams(temperature=0, max_tokens=48, json_object=True)
    for out in so_llm.generate(prompts, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_regex_and_choice_outputs_match(so_llm, temperature):
    tok = so_llm.tokenizer
    dates = [chat(tok, f"On which date did {p} start work?") for p in PEOPLE[:4]]
    colours = [chat(tok, f"Which colour suits {t}?") for t in THINGS[:4]]
    params = ([SamplingParams(temperature=temperature, seed=i, max_tokens=16, regex=DATE_REGEX)
               for i in range(4)]
              + [SamplingParams(temperature=temperature, seed=i, max_tokens=16, choice=COLOURS)
                 for i in range(4)])
    outputs = so_llm.generate(dates + colours, params, use_tqdm=False)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
    assert all(re.fullmatch(DATE_REGEX, o.text) for o in outputs[:4]), [o.text for o in outputs]
    assert all(o.text in COLOURS for o in outputs[4:]), [o.text for o in outputs[4:]]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_unconstrained_requests_are_untouched_by_constrained_ones(so_llm, temperature):
    tok = so_llm.tokenizer
    free = [chat(tok, f"Tell me a fact about {t}.") for t in THINGS[:4]]
    constrained = [chat(tok, f"Describe {p} as a user record in JSON.") for p in PEOPLE[:4]]
    plain = SamplingParams(temperature=temperature, seed=7, max_tokens=24)
    alone = so_llm.generate(free, plain, use_tqdm=False)
    schema = SamplingParams(temperature=temperature, seed=3, max_tokens=24,
                            json_schema=PERSON_SCHEMA)
    mixed = so_llm.generate(free + constrained, [plain] * 4 + [schema] * 4, use_tqdm=False)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    # The constrained neighbours did follow their schema, as far as they got.
    assert all(o.text.startswith('{"name": "') for o in mixed[4:]), [o.text for o in mixed[4:]]
