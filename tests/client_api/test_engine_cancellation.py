"""Nothing a client does ends the engine: calls cancelled or past a 20 ms deadline at each point
of a request's life (waiting for admission, queued, running) while a long prefill step runs, beside
streams that must finish with the tokens of an undisturbed run. The fake worker (no model) holds
the long step until the test has done its damage, so each call is cut exactly where it should be.
"""

from __future__ import annotations

import asyncio
import threading

from scheduler_svc import SamplingParams
from scheduler_svc.engine.async_engine import AsyncEngine
from tests.scheduler.conftest import make_fake_engine
from tests.scheduler.fake_worker import fake_greedy

VOCAB = 64
LONG_PROMPT = [3 + i % 60 for i in range(400)]  # the "1,500-word prompt": one long prefill


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class HeldWorker:
    """The fake worker. The first step after `hold_after` requests have been prefilled is held
    (its thread blocked) until `release` is set, and the step that prefills LONG_PROMPT until
    `release_long` is: the worker, not the threads' timing, decides where each request stands
    when the test cuts its calls."""

    def __init__(self, worker, hold_after: int) -> None:
        self.worker = worker
        self.hold_after: int | None = hold_after
        self.prefilled = 0
        self.held = threading.Event()  # the held step has begun
        self.release = threading.Event()
        self.long_started = threading.Event()
        self.release_long = threading.Event()

    def execute_model(self, so):
        if any(len(r.prompt_token_ids) == len(LONG_PROMPT) for r in so.scheduled_new_reqs):
            self.long_started.set()
            assert self.release_long.wait(30)
        elif self.hold_after is not None and self.prefilled >= self.hold_after:
            self.hold_after = None  # once
            self.held.set()
            assert self.release.wait(30)
        self.prefilled += len(so.scheduled_new_reqs)
        return self.worker.execute_model(so)

    def __getattr__(self, name):
        return getattr(self.worker, name)


async def _drain(stream) -> list[int]:
    ids = []
    async for out in stream:
        ids += out.new_token_ids
    return ids


async def _cut(awaitable, how: str) -> None:
    """Awaits with a 20 ms deadline, or cancels after the call has started; either way the call
    must end with its cancellation and nothing else."""
    task = asyncio.ensure_future(awaitable)
    if how == "deadline":
        try:
            await asyncio.wait_for(task, 0.02)
        except TimeoutError:
            return
        raise AssertionError("the call finished within 20 ms while the engine was held")
    await asyncio.sleep(0)  # it starts (sends its command, or waits for a token)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("the call was not cancelled")


def test_cancels_and_deadlines_during_a_long_prefill_end_only_their_requests():
    core, fake = make_fake_engine(num_blocks=512, block_size=4, vocab_size=VOCAB,
                                  max_num_seqs=7, max_model_len=512,
                                  max_num_batched_tokens=1024)
    worker = HeldWorker(fake, hold_after=6)  # the four undisturbed and the two running
    core.executor.worker = worker
    engine = AsyncEngine(core)

    async def go():
        engine.start()
        prompts = [[5 + k, 6, 7, 8, 9] for k in range(4)]
        undisturbed = [await engine.add_request(f"keep-{k}", p, _params(30))
                       for k, p in enumerate(prompts)]
        keep_tasks = [asyncio.ensure_future(_drain(s)) for s in undisturbed]
        running = [await engine.add_request(f"run-{k}", [20 + k, 21], _params(200))
                   for k in range(2)]
        for stream in running:  # each has a token: it runs
            first = await stream.__anext__()
            assert first.new_token_ids

        # Held once all six have their first token: the long request and four more arrive
        # together, so the long one takes the last of the 7 slots and the four queue behind it.
        assert await asyncio.to_thread(worker.held.wait, 30)
        long_add = asyncio.ensure_future(engine.add_request("long", LONG_PROMPT, _params(5)))
        await asyncio.sleep(0)
        queued_adds = [asyncio.ensure_future(engine.add_request(f"queued-{k}", [40 + k, 41],
                                                                _params(10)))
                       for k in range(4)]
        await asyncio.sleep(0)
        worker.release.set()
        assert await asyncio.to_thread(worker.long_started.wait, 30)
        long_stream = await long_add
        queued = [await a for a in queued_adds]

        # The long prefill is running: cut calls at every point of their lives.
        cuts = [_cut(engine.add_request(f"late-{k}", [50, 51, k], _params(4)), "deadline")
                for k in range(30)]  # waiting for admission
        cuts += [_cut(engine.add_request(f"gone-{k}", [52, k], _params(4)), "cancel")
                 for k in range(5)]
        for k, stream in enumerate(queued):  # queued behind the full batch
            cuts.append(_cut(_drain(stream), "deadline" if k % 2 else "cancel"))
        for k, stream in enumerate(running):  # running
            cuts.append(_cut(_drain(stream), "deadline" if k else "cancel"))
        await asyncio.gather(*cuts)
        for stream in queued + running:
            stream.close()  # as the gRPC servicer does when its call ends
        worker.release_long.set()

        assert await _drain(long_stream) == fake_greedy(LONG_PROMPT, 5, VOCAB)
        for task, prompt in zip(keep_tasks, prompts, strict=True):
            assert await task == fake_greedy(prompt, 30, VOCAB)
        after = await engine.add_request("after", [9, 8, 7], _params(6))
        assert await _drain(after) == fake_greedy([9, 8, 7], 6, VOCAB)
        await asyncio.wait_for(engine.wait_until_idle(), 10)  # no stream left behind
        assert engine.dead is None
        assert engine.num_active == 0

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        engine.shutdown()
    scheduler = core.scheduler
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks - 1  # all freed


def _held_failing_executor(config, num_requests: int):
    """A FailingExecutor whose steps wait for `go`, and whose first step after every one of
    num_requests requests has been prefilled waits for `release`, then fails if `down` is set:
    the replica dies exactly when each request has its first token, whatever the thread timing
    (a fast fake worker could otherwise finish some requests before the test cut the worker)."""
    from tests.scheduler.test_worker_grace_engine import FailingExecutor

    class HeldFailingExecutor(FailingExecutor):
        def __init__(self) -> None:
            super().__init__(config)
            self.go = threading.Event()
            self.release = threading.Event()
            self.prefilled: set[str] = set()

        def collective_rpc(self, method, args=(), *rest, **kwargs):
            if method == "execute_model" and not self.down:
                assert self.go.wait(30)
                if len(self.prefilled) == num_requests:
                    assert self.release.wait(30)
                else:
                    self.prefilled.update(r.req_id for r in args[0].scheduled_new_reqs)
            return super().collective_rpc(method, args, *rest, **kwargs)

    return HeldFailingExecutor()


def test_cancels_and_deadlines_while_parked_end_only_their_requests():
    """The last replica dies: its requests park (moved) and new ones wait for admission within
    the grace period; calls cut there end alone, and the survivors resume on the replica that
    joins with the tokens of an undisturbed run."""
    from scheduler_svc.engine.replicas import ReplicatedEngine
    from tests.scheduler.test_worker_grace_engine import FailingExecutor, make_config

    config = make_config(block_size=16, worker_grace_s=60)
    dying = _held_failing_executor(config, num_requests=4)
    engine = AsyncEngine(ReplicatedEngine(config, [dying]))

    async def go():
        engine.start()
        keep_prompts = [[5 + k, 6, 7] for k in range(2)]
        adds = [asyncio.ensure_future(engine.add_request(f"keep-{k}", p, _params(40)))
                for k, p in enumerate(keep_prompts)]
        adds += [asyncio.ensure_future(engine.add_request(f"moved-{k}", [30 + k, 31],
                                                          _params(40)))
                 for k in range(2)]
        await asyncio.sleep(0)  # all four sent: no step runs before they are on the inbox
        dying.go.set()
        streams = [await add for add in adds]
        keepers, victims = streams[:2], streams[2:]
        firsts = [(await stream.__anext__()).new_token_ids for stream in streams]
        assert all(firsts)
        keep_tasks = [asyncio.ensure_future(_drain(s)) for s in keepers]
        dying.down = True
        dying.release.set()
        while len(engine.core.parked) < 4:  # all four moved, waiting for a replica
            await asyncio.sleep(0.005)
        cuts = [_cut(engine.add_request(f"new-{k}", [40, k], _params(4)), "deadline")
                for k in range(3)]
        cuts += [_cut(engine.add_request(f"gone-{k}", [41, k], _params(4)), "cancel")
                 for k in range(2)]
        cuts += [_cut(_drain(s), "deadline" if k else "cancel") for k, s in enumerate(victims)]
        await asyncio.gather(*cuts)
        for stream in victims:
            stream.close()
        await asyncio.wrap_future(engine.core.attach(FailingExecutor(config)))
        for k, (task, prompt) in enumerate(zip(keep_tasks, keep_prompts, strict=True)):
            assert firsts[k] + await task == fake_greedy(prompt, 40, VOCAB)
        after = await engine.add_request("after", [9, 8, 7], _params(6))
        assert await _drain(after) == fake_greedy([9, 8, 7], 6, VOCAB)
        await asyncio.wait_for(engine.wait_until_idle(), 10)
        assert engine.dead is None
        assert len(engine.core.parked) == 0

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        engine.shutdown()
