"""Constraints over the client gRPC API of a real `batchwire serve` process on loopback: a good
one is followed, each bad one gets INVALID_ARGUMENT naming its field before any engine step, and
the request sent right after it succeeds."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import ServerProcess, collect, text_request

from .conftest import COLOURS, DATE_REGEX, PERSON_SCHEMA

pytestmark = pytest.mark.slow

S = generate_pb2.SamplingParams

BAD = [
    # (case id, sampling, the field the status message must start with, words it must hold)
    ("schema not JSON", S(json_schema="{"), "sampling.json_schema", "not valid JSON"),
    ("schema does not compile", S(json_schema='{"type": "bogus"}'), "sampling.json_schema",
     "does not compile"),
    ("integer bounds crossed", S(json_schema='{"type": "integer", "minimum": 9, "maximum": 1}'),
     "sampling.json_schema", "minimum greater than maximum"),
    ("grammar does not compile", S(grammar="root ::= ("), "sampling.grammar", "does not compile"),
    ("empty choice list", S(choice=generate_pb2.Choices()), "sampling.choice", "at least one"),
    ("regex does not compile", S(regex="(ab"), "sampling.regex", "does not compile"),
    ("regex matches nothing", S(regex=r"ab[^\d\D]"), "sampling.regex", "cannot match any text"),
    ("min_tokens with a constraint", S(regex="a+", min_tokens=2), "sampling.min_tokens",
     "cannot be combined"),
    # Once an INTERNAL error (RecursionError in the JSON parser), now refused before parsing.
    ("schema nested 5000 deep", S(json_schema='{"items": ' * 5000 + "{}" + "}" * 5000),
     "sampling.json_schema", "the limit is 64"),
    ("100000 brackets", S(json_schema="[" * 100_000), "sampling.json_schema", "the limit is 64"),
    ("schema nothing satisfies", S(json_schema='{"not": {}}'), "sampling.json_schema",
     "admits no value"),
    ("allOf of string and integer",
     S(json_schema='{"allOf": [{"type": "string"}, {"type": "integer"}]}'),
     "sampling.json_schema", "admits no value"),
    ("grammar nested 2000 deep", S(grammar="root ::= " + "(" * 2000 + '"a"' + ")" * 2000),
     "sampling.grammar", "the limit is 64"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("so-server"))
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


def steps(server) -> float:
    match = re.search(r"^batchwire_engine_steps_total (\S+)$", server.metrics(), re.M)
    assert match, "no step counter in /metrics"
    return float(match.group(1))


def settled_steps(server) -> float:
    """The step count once the engine is idle: a finished request's last step (telling the worker
    it finished) may come just after its stream ended."""
    server.wait_idle()
    previous, count = -1.0, steps(server)
    while count != previous:
        time.sleep(0.2)
        previous, count = count, steps(server)
    return count


def test_constraints_are_followed_over_the_wire(server):
    colour = S(temperature=0, max_tokens=8, choice=generate_pb2.Choices(choices=COLOURS))
    _, text, last, _ = collect(server.stub.Generate(
        text_request("The sky on a clear day is", colour), timeout=120))
    assert text in COLOURS and last.finish_reason == "stop"
    date = S(temperature=1.0, seed=5, max_tokens=16, regex=DATE_REGEX)
    _, text, last, _ = collect(server.stub.Generate(text_request("Today is", date), timeout=120))
    assert re.fullmatch(DATE_REGEX, text) and last.finish_reason == "stop", text
    record = S(temperature=0, max_tokens=64, json_schema=json.dumps(PERSON_SCHEMA))
    _, text, last, _ = collect(server.stub.Generate(
        text_request("A user record in JSON:", record), timeout=120))
    assert last.finish_reason == "stop" and set(json.loads(text)) == set(PERSON_SCHEMA["required"])


@pytest.mark.parametrize(("case", "sampling", "field", "words"), BAD, ids=[b[0] for b in BAD])
def test_each_bad_constraint_is_refused_and_the_next_request_runs(server, case, sampling, field,
                                                                   words):
    before = settled_steps(server)
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(text_request("Hi", sampling), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    assert e.value.details().startswith(field), e.value.details()
    assert words in e.value.details(), e.value.details()
    assert steps(server) == before, "a refused request reached the engine"
    good = S(temperature=0, max_tokens=8, choice=generate_pb2.Choices(choices=["yes", "no"]))
    _, text, last, _ = collect(server.stub.Generate(text_request("Is water wet?", good),
                                                    timeout=60))
    assert text in ("yes", "no") and last.finish_reason == "stop"
