"""Async scheduling gives every client exactly what the synchronous engine gives, over uni, zmq and
grpc: requests stopping mid-run by EOS, a stop token, a stop string and max_tokens, greedy and
seeded, one aborted mid-run, and (in process, with a small KV pool) preemptions. No extra token
reaches any client: the token computed for a request the step before stopped is dropped."""

from __future__ import annotations

import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from tests.stop_strings import stop_across_tokens

from .conftest import scheduler_config

EOS = 2  # the default tokenizer's <|im_end|>, which the engine stops on
PROMPTS = [[(31 * i + 7 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(7)]
ABORTED, ABORT_AFTER = "r6", 6  # aborted after this many engine steps


def free_run(model: str, tokenizer) -> dict[str, tuple[list[int], str]]:
    """What each prompt generates with nothing stopping it (greedy, then seeded for r4)."""
    engine = EngineCore(scheduler_config(model), tokenizer=tokenizer)
    try:
        params = [_free(i) for i in range(len(PROMPTS))]
        return {r: (o.token_ids, o.text) for r, o in run_clients(engine, params).items()}
    finally:
        engine.shutdown()


def _free(i: int) -> SamplingParams:
    if i == 4:
        return SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def stopping_params(free: dict[str, tuple[list[int], str]]) -> list[SamplingParams]:
    """Each request stops mid-run, each in its own way (chosen from its free run)."""
    tokens = {r: t for r, (t, _) in free.items()}
    text = free["r2"][1]
    return [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens["r0"][8]]),
        # EOS forced once min_tokens lets it through: logit_bias makes it the greedy choice.
        SamplingParams(temperature=0, max_tokens=30, min_tokens=11, logit_bias={EOS: 100.0}),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       stop=[text[len(text) // 2:len(text) // 2 + 2]]),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[tokens["r4"][12]]),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # aborted
    ]


class Client:
    """What one client saw: its deltas in order, and that nothing came after its last one."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_output_tokens = 0

    def take(self, out) -> None:
        assert self.finish_reason is None, f"{out.request_id}: an output after its last one"
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def run_clients(engine: EngineCore, params: list[SamplingParams], abort: bool = False,
         prompts: list[list[int]] = PROMPTS, abort_after: int = ABORT_AFTER
         ) -> dict[str, Client]:
    """Request ri is prompts[i] with params[i]; with abort, ABORTED is aborted after
    abort_after engine steps."""
    clients = {f"r{i}": Client() for i in range(len(params))}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"r{i}")
    steps = 0
    while engine.has_requests():
        for out in engine.step():
            clients[out.request_id].take(out)
        steps += 1
        if abort and steps == abort_after:
            for out in engine.abort_requests([ABORTED]):
                clients[out.request_id].take(out)
    for c in clients.values():
        assert c.num_output_tokens == len(c.token_ids)  # the counts say what was streamed
    return clients


@pytest.fixture(scope="module")
def reference(tiny_llama, default_tokenizer):
    free = free_run(tiny_llama, default_tokenizer)
    params = stopping_params(free)
    engine = EngineCore(scheduler_config(tiny_llama), tokenizer=default_tokenizer)
    try:
        clients = run_clients(engine, params)
    finally:
        engine.shutdown()
    reasons = {r: c.finish_reason for r, c in clients.items()}
    assert reasons == {"r0": "stop", "r1": "stop", "r2": "stop", "r3": "length", "r4": "stop",
                       "r5": "length", "r6": "length"}
    for r in ("r0", "r1", "r2", "r4"):  # mid-run: well before max_tokens
        assert 3 < len(clients[r].token_ids) < 29, (r, clients[r].token_ids)
    assert clients["r1"].token_ids[-1] == EOS and len(clients["r1"].token_ids) == 12
    return params, clients


@pytest.mark.parametrize("backend", ["uni", "zmq", "grpc"])
def test_async_scheduling_gives_every_client_the_synchronous_output(
        backend, shared_worker, tiny_llama, default_tokenizer, reference):
    params, expected = reference
    addresses = () if backend == "uni" else (shared_worker.address(backend),)
    config = scheduler_config(tiny_llama, backend, addresses, async_scheduling=True)
    engine = EngineCore(config, tokenizer=default_tokenizer)
    try:
        assert engine.async_scheduling
        clients = run_clients(engine, params, abort=True)
        assert not engine.scheduler.requests and not engine.has_requests()
    finally:
        engine.shutdown()
    assert_same(clients, expected, aborted=ABORTED)


def assert_same(got: dict[str, Client], want: dict[str, Client], aborted: str | None = None
                ) -> None:
    """Every client got the reference's tokens, text and finish reason; the aborted one a
    prefix of them, ended by the abort."""
    for r, w in want.items():
        g = got[r]
        if r == aborted:
            assert g.finish_reason == "abort"
            assert 0 < len(g.token_ids) < len(w.token_ids)
            assert g.token_ids == w.token_ids[:len(g.token_ids)]
            continue
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), r


def test_async_scheduling_survives_preemption(tiny_llama, default_tokenizer, reference):
    """A KV pool too small for every request at once: requests are preempted, some while a
    step of theirs is in flight, and still end with the synchronous engine's output."""
    params, expected = reference
    small = dict(kv_cache_memory_bytes=12 * 16 * 512, max_model_len=96)
    outputs = {}
    for async_scheduling in (False, True):
        config = scheduler_config(tiny_llama, async_scheduling=async_scheduling, **small)
        engine = EngineCore(config, tokenizer=default_tokenizer)
        try:
            outputs[async_scheduling] = run_clients(engine, params)
            assert engine.scheduler.stats.num_preemptions > 0
            engine.scheduler.kv.check_invariants()
        finally:
            engine.shutdown()
    for r, want in expected.items():
        for got in outputs.values():
            assert (got[r].token_ids, got[r].text, got[r].finish_reason) == (
                want.token_ids, want.text, want.finish_reason), r


def test_async_scheduling_with_speculative_decoding(tiny_llama, default_tokenizer, reference):
    """Speculative decoding on, in process: every client still gets the synchronous engine's
    output (without speculation), the aborted one a prefix of it (the full check, with drafts
    accepted, over every transport: test_async_spec_decode.py)."""
    params, expected = reference
    config = scheduler_config(tiny_llama, async_scheduling=True, speculative_method="ngram",
                              prompt_lookup_min=1)
    engine = EngineCore(config, tokenizer=default_tokenizer)
    try:
        assert engine.async_scheduling and engine.scheduler.spec is not None
        clients = run_clients(engine, params, abort=True)
        assert engine.scheduler.stats.num_draft_tokens > 0
    finally:
        engine.shutdown()
    assert_same(clients, expected, aborted=ABORTED)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_a_stop_string_across_two_steps_ends_the_stream_at_its_token(spec, tiny_llama,
                                                                      default_tokenizer):
    """Async scheduling on (and speculative decoding): a stop string whose characters come from
    two tokens (two steps) ends each request at the second token, its text cut before the string
    (or after it, with include_stop_str_in_output), offline (text inline after each step) and
    through the AsyncEngine (text on its event loop, the engine told afterwards): what the
    engine sampled past the stop never reaches the stream, and every block comes back."""
    import asyncio

    from scheduler_svc.engine.async_engine import AsyncEngine

    config = scheduler_config(tiny_llama, async_scheduling=True,
                              **(dict(speculative_method="ngram", prompt_lookup_min=1)
                                 if spec else {}))
    engine = EngineCore(config, tokenizer=default_tokenizer)
    free = run_clients(engine, [_free(i) for i in range(len(PROMPTS))])
    params, want = [], {}
    for i in range(len(PROMPTS)):
        r, ids = f"r{i}", free[f"r{i}"].token_ids
        found = stop_across_tokens(default_tokenizer, ids)
        base = _free(i)
        if found is None:
            params.append(base)
            want[r] = (ids, free[r].text, "length", None)
            continue
        stop, start, n = found
        include = i % 2 == 1
        params.append(SamplingParams(temperature=base.temperature, seed=base.seed,
                                     max_tokens=30, ignore_eos=True, stop=[stop],
                                     include_stop_str_in_output=include))
        want[r] = (ids[:n], free[r].text[:start + len(stop) if include else start], "stop", stop)
    assert sum(w[2] == "stop" for w in want.values()) >= 3, want

    offline = run_clients(engine, params)

    async def through_async_engine():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        streams = {f"r{i}": await async_engine.add_request(f"r{i}", PROMPTS[i], p)
                   for i, p in enumerate(params)}
        clients = {}
        for r, stream in streams.items():
            clients[r] = Client()
            async for out in stream:
                clients[r].take(out)
                clients[r].stop_reason = out.stop_reason
        await async_engine.wait_until_idle()
        return async_engine, clients

    async_engine, streamed = asyncio.run(through_async_engine())
    try:
        assert not engine.scheduler.requests and not engine.requests
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1
        assert not spec or engine.scheduler.stats.num_draft_tokens > 0
    finally:
        async_engine.shutdown()
    for r, (ids, text, reason, stop) in want.items():
        for got in (offline[r], streamed[r]):
            assert (got.token_ids, got.text, got.finish_reason) == (ids, text, reason), r
            assert got.num_output_tokens == len(ids)
        assert streamed[r].stop_reason == stop
