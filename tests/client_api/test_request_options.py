"""Request options that change what is run rather than how tokens are chosen, on a real server."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from batchwire.v1 import generate_pb2

from scheduler_svc.core.parallel_sampling import child_seed
from tests.client_api.server_process import collect, greedy

pytestmark = pytest.mark.slow

R = generate_pb2.GenerateRequest


def test_truncated_prompt_runs_as_the_truncated_prompt_sent(server, default_tokenizer):
    ids = default_tokenizer("Once upon a time, in a land far away, there lived a king who had "
                            "three daughters. The youngest", add_special_tokens=False).input_ids
    k = 12
    cut = collect(server.stub.Generate(R(token_ids=ids, sampling=greedy(
        8, truncate_prompt_tokens=k)), timeout=120))
    sent = collect(server.stub.Generate(R(token_ids=ids[-k:], sampling=greedy(8)), timeout=120))
    whole = collect(server.stub.Generate(R(token_ids=ids, sampling=greedy(8)), timeout=120))
    assert cut[0] == sent[0] and cut[1] == sent[1]
    assert cut[2].usage.prompt_tokens == k and whole[2].usage.prompt_tokens == len(ids)
    assert cut[0] != whole[0], "the cut must matter for this test to show anything"
    # A prompt longer than max_model_len (256) runs once truncated.
    long = collect(server.stub.Generate(R(token_ids=[100] * 300 + ids[-k:], sampling=greedy(
        8, truncate_prompt_tokens=k)), timeout=120))
    assert long[0] == sent[0]


def _by_index(responses) -> tuple[dict[int, list[int]], dict[int, str], generate_pb2.Usage]:
    """Token ids and finish reason per sequence index, and the usage of the stream's last
    message (the only one that carries usage)."""
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    messages = list(responses)
    for m in messages:
        ids.setdefault(m.index, []).extend(m.token_ids)
        if m.HasField("finish_reason"):
            assert m.index not in reasons, "a sequence ended twice"
            reasons[m.index] = m.finish_reason
    assert [m.HasField("usage") for m in messages].count(True) == 1
    assert messages[-1].HasField("usage")
    return ids, reasons, messages[-1].usage


def _prefix_hits(server) -> float:
    match = re.search(r"^batchwire_prefix_cache_hits_total (\S+)$", server.metrics(), re.M)
    assert match, "no prefix-cache counter in /metrics"
    return float(match.group(1))


PROMPT = "Write a short poem about the sea and the wind over it"


def test_n4_greedy_gives_four_copies_of_one_request_and_prefills_once(server):
    one = collect(server.stub.Generate(R(text=PROMPT, sampling=greedy(6)), timeout=120))
    server.wait_idle()
    hits = _prefix_hits(server)
    # A salt of its own: no earlier request's blocks can be hit, only the sequences' own.
    ids, reasons, usage = _by_index(server.stub.Generate(R(
        text=PROMPT, sampling=greedy(6, n=4), cache_salt="n4-greedy"), timeout=120))
    prompt_len = one[2].usage.prompt_tokens
    assert ids == {i: one[0] for i in range(4)}
    assert reasons == {i: "length" for i in range(4)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, 24)
    assert usage.total_tokens == prompt_len + 24
    # Sequences 1-3 found the prompt's full blocks, which sequence 0 allocated and computed.
    assert _prefix_hits(server) - hits == 3 * (prompt_len // 16) * 16
    server.wait_idle()


def _seeded(n: int, seed: int) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True,
                                       n=n)


def test_n4_seeded_is_reproducible_distinct_and_each_as_its_own_seed_gives(server):
    first, _, _ = _by_index(server.stub.Generate(R(text=PROMPT, sampling=_seeded(4, 11)),
                                                 timeout=120))
    again, _, _ = _by_index(server.stub.Generate(R(text=PROMPT, sampling=_seeded(4, 11)),
                                                 timeout=120))
    assert first == again
    assert len({tuple(v) for v in first.values()}) == 4
    # Sequence i alone, with (seed, i)'s seed, beside unrelated work in the batch.
    with ThreadPoolExecutor(5) as pool:
        noise = pool.submit(lambda: collect(server.stub.Generate(
            R(text="Count to twenty:", sampling=greedy(24)), timeout=120)))
        alone = [pool.submit(lambda i=i: collect(server.stub.Generate(
            R(text=PROMPT, sampling=_seeded(1, child_seed(11, i))), timeout=120))[0])
            for i in range(4)]
        assert {i: f.result() for i, f in enumerate(alone)} == first
        noise.result()
    server.wait_idle()


def test_aborting_the_call_aborts_all_n(server):
    sampling = greedy(200, n=3)
    ended: dict[int, str] = {}
    started = threading.Event()

    def read() -> None:
        for m in server.stub.Generate(R(request_id="n3-abort", text=PROMPT, sampling=sampling),
                                      timeout=120):
            started.set()
            if m.HasField("finish_reason"):
                ended[m.index] = m.finish_reason

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    aborted = server.stub.Abort(generate_pb2.AbortRequest(request_ids=["n3-abort"]), timeout=10)
    reader.join(60)
    assert list(aborted.aborted_request_ids) == ["n3-abort"]
    assert ended == {0: "abort", 1: "abort", 2: "abort"}
    # Cancelling the call instead frees every sequence's blocks too.
    call = server.stub.Generate(R(text=PROMPT, sampling=sampling), timeout=120)
    next(call)
    call.cancel()
    server.wait_idle()


SALTED = ("A ledger of the harbour master, page forty: three schooners from the north, two "
          "barges of grain, one steamer under repair, and a fishing fleet waiting for the tide")


def test_cache_salt_keeps_prefix_hits_within_one_salt(server):
    def cached(salt: str) -> int:
        server.wait_idle()
        before = _prefix_hits(server)
        _, _, last, _ = collect(server.stub.Generate(R(text=SALTED, sampling=greedy(2),
                                                       cache_salt=salt), timeout=60))
        # The engine's own count agrees with what the client is told.
        assert _prefix_hits(server) - before == last.usage.cached_tokens
        assert last.usage.prompt_tokens >= 32, "the prompt must fill two blocks at least"
        return last.usage.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0, "another salt must not hit tenant-a's blocks"
    assert cached("") == 0, "nor must an unsalted request"
    assert cached("tenant-a") >= 32, "the same salt hits its full blocks"
    assert cached("") >= 32, "unsalted requests share among themselves"


def test_priority_is_refused_by_a_server_without_the_priority_policy(server):
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(R(text=PROMPT, sampling=greedy(2), priority=3), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("priority: 3")
    _, _, last, _ = collect(server.stub.Generate(R(text=PROMPT, sampling=greedy(2), priority=0),
                                                 timeout=30))
    assert last.finish_reason == "length"
