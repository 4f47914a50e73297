"""The OpenAI-compatible HTTP API through the official `openai` SDK (sync and async clients),
against the shared session server, with its gRPC API as the reference: the same engine must
give the same tokens, logprobs and prompt logprobs through either."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import jsonschema
import openai
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import collect, greedy, text_request
from tests.client_api.test_metrics import ABORTED, _value

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def run_async(server, main):
    async def wrapped():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused",
                                      max_retries=0, timeout=120) as c:
            return await main(c)

    return asyncio.run(asyncio.wait_for(wrapped(), 120))


def grpc_chat(server, messages, sampling):
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(**m) for m in messages], sampling=sampling)
    return collect(server.stub.Generate(request, timeout=120))


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_greedy_chat_equals_grpc_token_for_token(server, client, default_tokenizer):
    ids, text, last, _ = grpc_chat(server, HELLO, greedy(8, ignore_eos=False))
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                           temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert [t.token for t in choice.logprobs.content] == [
        default_tokenizer.decode([i]) for i in ids]
    assert reply.usage.completion_tokens == len(ids) == last.usage.completion_tokens
    assert reply.usage.prompt_tokens == last.usage.prompt_tokens
    assert choice.finish_reason == last.finish_reason


def test_async_stream_with_usage_counts_the_tokens_streamed(server):
    async def main(c):
        stream = await c.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=6, temperature=0, stream=True,
            logprobs=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [chunk async for chunk in stream]

    chunks = run_async(server, main)
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert all(c.usage is None for c in choice_chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    streamed = sum(len(c.choices[0].logprobs.content) for c in choice_chunks
                   if c.choices[0].logprobs is not None)
    assert streamed == usage_chunk.usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    _, grpc_text, _, _ = grpc_chat(server, HELLO, greedy(6))
    assert text == grpc_text


def test_n_two_with_a_seed_is_reproducible_and_matches_grpc(server, client):
    # The same seed gives the same sequences through either API, whatever else runs.
    first = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, seed=11,
                                           temperature=1.0, max_tokens=6)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(**m) for m in HELLO],
        sampling=generate_pb2.SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=6))
    by_index: dict[int, str] = {0: "", 1: ""}
    tokens = 0
    for msg in server.stub.Generate(request, timeout=120):
        by_index[msg.index] += msg.text
        tokens += len(msg.token_ids)
    assert texts == [by_index[0], by_index[1]]
    assert first.usage.completion_tokens == tokens


def test_top_logprobs_are_sorted_and_greedy_picks_the_first(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == top[0]
        assert bytes(entry.bytes) == entry.token.encode()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_validates(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_a_required_tool_call_parses_and_validates(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    assert call.type == "function" and call.function.name in tools and call.id
    jsonschema.validate(json.loads(call.function.arguments),
                        tools[call.function.name]["function"]["parameters"])
    # The conversation goes on with the call and its result.
    follow = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.content


def test_a_named_tool_call_streams_as_one_call(server):
    async def main(c):
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40, temperature=0, stream=True)
        return [chunk async for chunk in stream]

    chunks = run_async(server, main)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    (call,) = calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_echo_with_logprobs_gives_the_grpc_prompt_logprobs(server, client, default_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = default_tokenizer(prompt).input_ids
    request = generate_pb2.GenerateRequest(token_ids=ids, sampling=greedy(1, prompt_logprobs=1))
    first = next(iter(server.stub.Generate(request, timeout=60)))
    expected = [lp.logprob for lp in first.prompt_logprobs]
    for given in (prompt, ids):  # text and token ids
        reply = client.completions.create(model=MODEL, prompt=given, echo=True, logprobs=1,
                                          max_tokens=0, temperature=0)
        choice = reply.choices[0]
        assert choice.text == prompt
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == expected
        assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(ids)
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_several_prompts_are_numbered_prompt_major(server, client):
    prompts = ["One, two,", "Monday, Tuesday,"]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        _, text, _, _ = collect(server.stub.Generate(text_request(p, greedy(4)), timeout=60))
        assert reply.choices[2 * i].text == reply.choices[2 * i + 1].text == text
    assert reply.usage.completion_tokens == 16


def test_a_cancelled_stream_frees_its_blocks(server):
    server.wait_idle()
    before = server.metrics()

    async def main(c):
        stream = await c.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        seen = 0
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
            if seen == 2:
                break
        assert server.server_info().kv_blocks_used > 0  # still running, holding blocks
        await stream.close()  # the client goes away

    run_async(server, main)
    deadline = time.monotonic() + 20
    while _value(server.metrics(), ABORTED) == _value(before, ABORTED):
        assert time.monotonic() < deadline, "the disconnected stream was never aborted"
        time.sleep(0.05)
    info = server.wait_idle(timeout_s=5)
    assert info.kv_blocks_used == 0 and info.num_running_requests == 0


def test_32_concurrent_streams_all_complete(server):
    async def one(c, i):
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Count."},
                                   {"role": "user", "content": str(i)}],
            max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        return chunks[-1].usage.completion_tokens, [c for c in chunks if c.choices][-1]

    async def main(c):
        return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = run_async(server, main)
    assert len(results) == 32
    assert all(n == 4 and last.choices[0].finish_reason == "length" for n, last in results)
    server.wait_idle()


def http(server, path: str, body=None) -> tuple[int, bytes]:
    """A plain HTTP call to a route beside /v1."""
    url = server.base_url.removesuffix("/v1") + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.status, r.read()


def test_side_routes(server):
    assert http(server, "/health") == (200, b"")
    assert json.loads(http(server, "/version")[1])["version"]
    assert b"batchwire_engine_steps_total" in http(server, "/metrics")[1]
    tokens = json.loads(http(server, "/tokenize", {"prompt": "Hello world"})[1])
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    text = json.loads(http(server, "/detokenize", {"tokens": tokens["tokens"]})[1])["prompt"]
    assert text == "Hello world"
    chat = json.loads(http(server, "/tokenize", {"messages": HELLO})[1])["tokens"]
    request = generate_pb2.TokenizeRequest(
        messages=[generate_pb2.ChatMessage(**m) for m in HELLO])
    assert chat == list(server.stub.Tokenize(request, timeout=10).token_ids)
    spec = json.loads(http(server, "/openapi.json")[1])
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
            "/tokenize", "/detokenize", "/health", "/version", "/metrics"} <= set(spec["paths"])
