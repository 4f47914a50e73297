"""Async scheduling with speculative decoding gives every client what the synchronous engine
gives, with and without speculation, over uni, zmq and grpc: greedy requests, some on repeating
prompts whose drafts are accepted, stopping mid-run by a stop token, EOS, a stop string and
max_tokens, one aborted mid-run, nothing after a client's last output; and (in process, with a
small KV pool) preemptions. The two halves of the running requests take turns: each step sent
to the worker holds requests that the step before did not, while that one's tokens are still
being applied."""

from __future__ import annotations

import pytest

from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore

from .conftest import scheduler_config
from .test_async_scheduling import ABORTED, EOS, Client, assert_same, run_clients

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
# Four arithmetic prompts and four that repeat a short phrase.
PROMPTS = ([[(31 * i + 7 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
           + [[(17 * i + 5 * (j % (3 + i))) % 500 + 3 for j in range(24)] for i in range(4)])
ABORT_AFTER = 8  # ABORTED (r6) is aborted after this many engine steps
MAX_TOKENS = 40


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                            **kwargs})


def _run(engine: EngineCore, params: list[SamplingParams], abort: bool = False
         ) -> dict[str, Client]:
    return run_clients(engine, params, abort, PROMPTS, ABORT_AFTER)


def _engine(model, tokenizer, **overrides) -> EngineCore:
    return EngineCore(scheduler_config(model, **overrides), tokenizer=tokenizer)


def _stopping_params(free: dict[str, Client]) -> list[SamplingParams]:
    """Each request stops mid-run in its own way, chosen from its free run."""
    text = free["r2"].text
    return [
        _greedy(stop_token_ids=[free["r0"].token_ids[8]]),
        # EOS, forced once min_tokens lets it through: logit_bias makes it the greedy choice.
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=13,
                       logit_bias={EOS: 100.0}),
        _greedy(stop=[text[len(text) // 2:len(text) // 2 + 2]]),
        # A random model seldom repeats itself: a logit bias makes these outputs repeat, so that
        # drafts are accepted (all of them for r3, some for the others).
        _greedy(max_tokens=9, logit_bias={17: 100.0}),
        _greedy(stop_token_ids=[free["r4"].token_ids[14]]),
        _greedy(max_tokens=23, logit_bias={17: 8.0}),
        _greedy(logit_bias={17: 8.0, 29: 8.0}),  # aborted
        _greedy(max_tokens=31, logit_bias={17: 12.0, 29: 12.0}),
    ]


@pytest.fixture(scope="module")
def references(tiny_llama, default_tokenizer):
    """The stopping requests' outputs from the synchronous engine, without and with speculation
    (both must be what async scheduling with speculation gives)."""
    engine = _engine(tiny_llama, default_tokenizer)
    try:
        params = _stopping_params(_run(engine, [_greedy() for _ in PROMPTS]))
        plain = _run(engine, params)
    finally:
        engine.shutdown()
    engine = _engine(tiny_llama, default_tokenizer, **SPEC)
    try:
        spec = _run(engine, params)
        assert engine.scheduler.stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()
    assert {r: c.finish_reason for r, c in plain.items()} == {
        "r0": "stop", "r1": "stop", "r2": "stop", "r3": "length", "r4": "stop",
        "r5": "length", "r6": "length", "r7": "length"}
    for r in ("r0", "r2", "r4"):  # mid-run: well before max_tokens
        assert 3 < len(plain[r].token_ids) < MAX_TOKENS - 1, (r, plain[r].token_ids)
    assert plain["r1"].token_ids[-1] == EOS and len(plain["r1"].token_ids) == 14
    return params, plain, spec


class SentSteps:
    """The wire ids of the requests in each step the engine sends to its worker (the real
    executor still runs every call)."""

    def __init__(self, engine: EngineCore) -> None:
        self.steps: list[set[str]] = []
        execute = engine.executor.execute_model

        def record(so, non_block=False):
            self.steps.append({r.req_id for r in so.scheduled_new_reqs}
                              | set(so.scheduled_cached_reqs.req_ids))
            return execute(so, non_block=non_block)

        engine.executor.execute_model = record  # type: ignore[method-assign]

    def turns(self) -> int:
        """Steps that follow one with requests of their own, none of them shared: the step
        before is still in flight (its tokens not yet applied) while this one is sent."""
        return sum(1 for a, b in zip(self.steps, self.steps[1:], strict=False)
                   if len(a) >= 2 and len(b) >= 2 and not a & b)


@pytest.mark.parametrize("backend", ["uni", "zmq", "grpc"])
def test_async_spec_decoding_gives_every_client_the_synchronous_output(
        backend, shared_worker, tiny_llama, default_tokenizer, references):
    params, plain, spec = references
    assert_same(spec, plain)  # speculation changes no token
    addresses = () if backend == "uni" else (shared_worker.address(backend),)
    engine = _engine(tiny_llama, default_tokenizer, backend=backend, addresses=addresses,
                     async_scheduling=True, **SPEC)
    sent = SentSteps(engine)
    try:
        assert engine.async_scheduling
        clients = _run(engine, params, abort=True)
        assert not engine.scheduler.requests and not engine.has_requests()
        stats = engine.scheduler.stats
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1
    finally:
        engine.shutdown()
    assert_same(clients, plain, aborted=ABORTED)
    # Eight requests in two cohorts of four: most steps take turns with the step before.
    assert sent.turns() >= 10, sent.steps
    assert max(len(s) for s in sent.steps[2:]) <= 5, sent.steps


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_spec_decoding_survives_preemption(policy, tiny_llama, default_tokenizer,
                                                 references):
    """A KV pool too small for every request at once: requests are preempted, some while a
    step of theirs (with drafts) is in flight, and still end with the synchronous output."""
    params, plain, _ = references
    small = dict(kv_cache_memory_bytes=12 * 16 * 512, max_model_len=96, policy=policy)
    outputs = {}
    for async_scheduling in (False, True):
        engine = _engine(tiny_llama, default_tokenizer, async_scheduling=async_scheduling,
                         **small, **SPEC)
        try:
            outputs[async_scheduling] = _run(engine, params)
            assert engine.scheduler.stats.num_preemptions > 0
            assert engine.scheduler.stats.num_accepted_tokens > 0
            engine.scheduler.kv.check_invariants()
        finally:
            engine.shutdown()
    for got in outputs.values():
        assert_same(got, plain)
