"""Generate and its companions on a real server: what streams back, and what a request costs."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from batchwire.v1 import generate_pb2

from scheduler_svc import SamplingParams
from tests.client_api.server_process import collect, greedy, text_request
from tests.stop_strings import stop_across_tokens

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "日本の首都は",  # Japanese output whose characters span several byte-level tokens
]
MAX_TOKENS = 16
NEAR_TIE = 2e-3  # log-probabilities; float32 sums in another order move them by ~1e-5


@pytest.fixture(scope="module")
def reference(offline_llm):
    """The offline API's greedy output for each prompt, one request at a time as the server runs
    them below, so that both see the same batch shapes."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {p: offline_llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS}


@pytest.fixture(scope="module")
def streamed(reference, server):
    """The server's messages for the same requests, one request at a time."""
    sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {p: list(server.stub.Generate(text_request(p, sampling), timeout=120))
            for p in PROMPTS}


def test_greedy_stream_equals_offline_api(reference, streamed):
    for prompt in PROMPTS:
        ids, text, last, count = collect(streamed[prompt])
        ref = reference[prompt]
        assert ids == ref.token_ids, prompt
        assert text == ref.text, prompt
        assert last.finish_reason == ref.finish_reason
        assert count > 1, "the output should stream, not arrive in one message"
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == len(ids)
        assert last.usage.total_tokens == len(ref.prompt_token_ids) + len(ids)


def test_text_stays_whole_across_multibyte_characters(streamed, default_tokenizer):
    messages = streamed["日本の首都は"]
    ids = [t for m in messages for t in m.token_ids]
    # The prompt was chosen because its output splits characters across tokens.
    assert any("\ufffd" in default_tokenizer.decode([t]) for t in ids)
    # Only the last message may end in a partial character: max_tokens cut it, and the rest
    # of its bytes will never come.
    assert not any("\ufffd" in m.text for m in messages[:-1])
    assert "".join(m.text for m in messages) == default_tokenizer.decode(ids)


def _first_divergence_is_near_tie(ours: list[int], logprobs, ref: list[int]) -> bool:
    """True when ours == ref, or they first differ where ours saw the reference's token within
    a near-tie of its own choice (later tokens continue another text and are not compared)."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top = {t.token_id: t.logprob for t in logprobs[j].top_logprobs}
            return b in top and top[a] - top[b] < NEAR_TIE
    return True


def test_32_concurrent_streams_complete_correctly(server, offline_llm):
    prompts = [PROMPTS[0], "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 5, 8, 13,"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = {p: o.token_ids for p, o in zip(
        prompts, offline_llm.generate(prompts, params, use_tqdm=False), strict=True)}
    start = threading.Barrier(32)

    def one(i: int):
        prompt = prompts[i % len(prompts)]
        request = text_request(prompt, greedy(8, logprobs=2), request_id=f"concurrent-{i}")
        start.wait()
        return prompt, list(server.stub.Generate(request, timeout=180))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for i, (prompt, messages) in enumerate(results):
        ids = [t for m in messages for t in m.token_ids]
        logprobs = [lp for m in messages for lp in m.logprobs]
        assert all(m.request_id == f"concurrent-{i}" for m in messages)
        assert messages[-1].finish_reason == "length" and len(ids) == 8
        assert [lp.token_id for lp in logprobs] == ids
        # Batches of other shapes than the reference's may order a near-tie differently.
        assert _first_divergence_is_near_tie(ids, logprobs, ref[prompt]), (prompt, ids)
    server.wait_idle()


def _blocks_in_use_while_streaming(server, call) -> int:
    next(call)  # the request is running: its prompt's blocks are held
    return server.server_info().kv_blocks_used


def test_cancelling_mid_stream_frees_the_blocks(server):
    call = server.stub.Generate(text_request("Tell me a long story.", greedy(200)), timeout=120)
    assert _blocks_in_use_while_streaming(server, call) > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    info = server.wait_idle()
    assert info.kv_blocks_used == 0 and info.num_running_requests == 0


def test_expired_deadline_aborts_and_frees_the_blocks(server):
    call = server.stub.Generate(text_request("Tell me a long story.", greedy(200)), timeout=2.0)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()


def test_duplicate_active_id_is_refused_and_abort_ends_the_stream(server):
    first = server.stub.Generate(text_request("Count to a hundred:", greedy(200),
                                              request_id="dup"), timeout=120)
    next(first)
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(text_request("Hi", greedy(2), request_id="dup"), timeout=30))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "dup" in e.value.details()

    aborted = server.stub.Abort(generate_pb2.AbortRequest(request_ids=["dup", "nobody"]))
    assert list(aborted.aborted_request_ids) == ["dup"]
    *_, last = first
    assert last.finish_reason == "abort"
    assert last.usage.completion_tokens < 200
    server.wait_idle()
    # Once finished, the id is free again.
    _, _, again, _ = collect(server.stub.Generate(
        text_request("Hi", greedy(2), request_id="dup"), timeout=60))
    assert again.finish_reason == "length"


def test_request_id_is_made_up_when_empty(server):
    messages = list(server.stub.Generate(text_request("Hi", greedy(2)), timeout=60))
    ids = {m.request_id for m in messages}
    assert len(ids) == 1 and len(ids.pop()) >= 16


def test_stop_string_ends_the_text_before_it(server):
    request = text_request("The capital of France is", greedy(24, stop=["."], ignore_eos=False))
    ids, text, last, _ = collect(server.stub.Generate(request, timeout=60))
    assert last.finish_reason == "stop"
    assert last.WhichOneof("stop_reason") == "stop_string" and last.stop_string == "."
    assert text == " Paris"


@pytest.mark.parametrize("include", [False, True])
def test_no_token_past_a_stop_string_reaches_the_client(server, reference, default_tokenizer,
                                                        include):
    """A stop string across two tokens ends the stream at the token that completes it: the
    server's event loop finds it in the text after the engine thread has moved on, and what the
    engine sampled since never reaches the client; the text is cut before the string (after it
    with include_stop_str_in_output)."""
    ref = reference[PROMPTS[0]]
    found = stop_across_tokens(default_tokenizer, ref.token_ids)
    assert found is not None, ref.text
    stop, start, n = found
    request = text_request(PROMPTS[0], greedy(MAX_TOKENS, stop=[stop],
                                              include_stop_str_in_output=include))
    ids, text, last, _ = collect(server.stub.Generate(request, timeout=60))
    assert ids == ref.token_ids[:n]
    assert text == ref.text[:start + len(stop) if include else start]
    assert last.finish_reason == "stop" and last.stop_string == stop
    assert last.usage.completion_tokens == n
    server.wait_idle()  # the engine confirmed the stop: the request holds nothing


def test_stop_token_id_is_reported(server, reference):
    ref = reference[PROMPTS[0]].token_ids  # " Paris", ".", "\n", ...
    request = text_request(PROMPTS[0], greedy(24, stop_token_ids=[ref[2]]))
    ids, _, last, _ = collect(server.stub.Generate(request, timeout=60))
    assert ids == ref[:3]
    assert last.finish_reason == "stop" and last.stop_token_id == ref[2]


def test_token_ids_and_chat_prompts(server, default_tokenizer):
    ids = default_tokenizer("The capital of France is").input_ids
    by_ids, _, _, _ = collect(server.stub.Generate(
        generate_pb2.GenerateRequest(token_ids=ids, sampling=greedy(3)), timeout=60))
    by_text, _, _, _ = collect(server.stub.Generate(
        text_request("The capital of France is", greedy(3)), timeout=60))
    assert by_ids == by_text

    chat = [{"role": "user", "content": "What is 2+2?"}]
    rendered = default_tokenizer.apply_chat_template(chat, tokenize=False,
                                                     add_generation_prompt=True)
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content="What is 2+2?")],
        sampling=greedy(8))
    _, _, last, _ = collect(server.stub.Generate(request, timeout=60))
    assert last.usage.prompt_tokens == len(default_tokenizer(rendered,
                                                             add_special_tokens=False).input_ids)


def test_a_repeated_prompt_reports_its_cached_prefix(server):
    prompt = ("You are a careful assistant. Answer in one plain sentence without lists. "
              "Question: what is the boiling point of water at sea level?")
    _, _, first, _ = collect(server.stub.Generate(text_request(prompt, greedy(2)), timeout=60))
    _, _, second, _ = collect(server.stub.Generate(text_request(prompt, greedy(2)), timeout=60))
    assert first.usage.prompt_tokens > 16
    assert second.usage.cached_tokens >= 16  # at least one full block of 16 came from the cache
    assert second.usage.cached_tokens < second.usage.prompt_tokens


def test_logprobs_when_asked(server):
    request = text_request("The capital of France is", greedy(4, logprobs=3))
    messages = list(server.stub.Generate(request, timeout=60))
    for m in messages:
        assert len(m.logprobs) == len(m.token_ids)
        for token, lp in zip(m.token_ids, m.logprobs, strict=True):
            assert lp.token_id == token and lp.rank == 1  # greedy: the most likely token
            assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token_id == token
            assert lp.logprob <= 0
    plain = list(server.stub.Generate(text_request("Hi", greedy(2)), timeout=60))
    assert not any(m.logprobs for m in plain)


def test_model_info(server, default_tokenizer):
    info = server.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152 and info.max_model_len == 256
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1
    assert info.has_chat_template and info.dtype == "float32"


def test_server_info(server):
    info = server.wait_idle()
    assert info.version and info.transport == "uni" and not info.draining
    assert [(w.address, w.state) for w in info.workers] == [
        ("in-process", generate_pb2.WORKER_STATE_READY)]
    assert info.kv_blocks_total == 90 and info.block_size == 16
    assert info.limits.max_model_len == 256 and info.limits.max_num_batched_tokens == 512
    assert info.limits.max_queued_requests > 0 and info.limits.max_message_bytes > 0


def test_tokenize_and_detokenize(server, default_tokenizer):
    text = "Hello, wörld — 日本"
    ids = server.stub.Tokenize(generate_pb2.TokenizeRequest(text=text), timeout=10).token_ids
    assert list(ids) == default_tokenizer(text).input_ids
    back = server.stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=ids), timeout=10)
    assert back.text == text
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=[49152]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("token_ids")


def test_metrics_are_served(server):
    list(server.stub.Generate(text_request("Hi", greedy(3)), timeout=60))
    deadline = time.monotonic() + 10
    while "batchwire_time_to_first_token_seconds_count" not in (text := server.metrics()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for name in ("batchwire_num_requests_running", "batchwire_num_requests_waiting",
                 "batchwire_kv_cache_usage_ratio", "batchwire_prefix_cache_hit_rate",
                 "batchwire_num_preemptions_total", "batchwire_time_per_output_token_seconds",
                 "batchwire_e2e_request_latency_seconds", "batchwire_prompt_tokens_total",
                 "batchwire_generation_tokens_total"):
        assert name in text, name
    assert re.search(r'batchwire_request_finished_total\{finished_reason="length",'
                     r'model_name="SmolLM2-135M-Instruct"\}', text), text


def test_reflection_describes_the_service(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    database = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(database.get_services())
    assert {"batchwire.v1.Generation", "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(database)
    method = pool.FindServiceByName("batchwire.v1.Generation").methods_by_name["Generate"]
    assert method.output_type.full_name == "batchwire.v1.GenerateResponse"
    assert "token_ids" in method.input_type.fields_by_name
