"""A deterministic stand-in for worker_svc.runner.worker.Worker, fast enough for property tests.

It speaks the same two-call protocol on the same protobuf messages and keeps its own copy of each
request's tokens, as the real worker does. Its "KV cache" is one (position, token) pair per slot,
written through the block table the scheduler sent; its "model" reads the sequence back through
the block table and hashes it. So a block shared, freed or evicted wrongly by the scheduler shows
up as a wrong token, exactly as stale KV would in a real model.

Draft tokens (speculative decoding) are verified greedily, as the real worker does: their KV is
written after the request's tokens, the model runs at every draft position, and drafts are kept
while they equal its token, then its own token is appended.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable

from batchwire.v1 import worker_pb2

NextToken = Callable[[list[int], int], int]  # (sequence, vocab size) -> the next token


def fake_next_token(tokens: list[int], vocab_size: int) -> int:
    """The fake model: the next token is a hash of the whole sequence."""
    return zlib.crc32(array("i", tokens).tobytes()) % vocab_size


def copy_next_token(tokens: list[int], vocab_size: int, period: int = 6) -> int:
    """A model that repeats the sequence with a period: n-gram drafts are always right."""
    return tokens[-period] if len(tokens) >= period and min(tokens) >= 0 else 0


def fake_greedy(prompt: list[int], num_tokens: int, vocab_size: int,
                next_token: NextToken = fake_next_token) -> list[int]:
    """What the fake model generates for a prompt run alone (no stop rule applied)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, vocab_size))
    return tokens[len(prompt):]


class _State:
    __slots__ = ("tokens", "block_ids", "num_computed")

    def __init__(self, tokens: list[int], block_ids: list[int]) -> None:
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed = 0


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 64,
                 eos_token_ids: tuple[int, ...] = (1,), max_model_len: int = 2048,
                 max_num_reqs: int = 256, next_token: NextToken = fake_next_token) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_reqs = max_num_reqs
        self.next_token = next_token
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # per slot
        self.requests: dict[str, _State] = {}
        self.parked: list[tuple[str, bool, list[int]]] | None = None
        self.num_steps = 0
        self.seen_outputs: list[worker_pb2.SchedulerOutput] = []

    def get_info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model_name="fake", vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            num_blocks=self.num_blocks, block_size=self.block_size, dtype="none", device="cpu",
            max_num_reqs=self.max_num_reqs, eos_token_ids=self.eos_token_ids)

    def execute_model(self, so: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput | None:
        if self.parked is not None:
            raise RuntimeError("execute_model called twice without sample_tokens")
        self.seen_outputs.append(so)
        self.num_steps += 1
        for req_id in so.finished_req_ids:
            assert req_id in self.requests, f"finished id {req_id!r} was never scheduled"
            del self.requests[req_id]
        drafts = {e.req_id: list(e.ids) for e in so.scheduled_spec_decode_tokens}
        work: list[tuple[str, int, int]] = []
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id!r} sent in full twice"
            # A request moved from another replica brings its output, recomputed here.
            self.requests[new.req_id] = _State([*new.prompt_token_ids, *new.output_token_ids],
                                               list(new.block_ids))
            work.append((new.req_id, new.num_computed_tokens, new.num_scheduled_tokens))
        cached = so.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids)
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            computed = cached.num_computed_tokens[i]
            if req_id in resumed:
                state.block_ids = list(cached.new_block_ids[i].ids)
            else:
                assert computed == state.num_computed, (req_id, computed, state.num_computed)
                state.block_ids.extend(cached.new_block_ids[i].ids)
            work.append((req_id, computed, cached.num_scheduled_tokens[i]))
        assert sum(n for _, _, n in work) == so.total_num_scheduled_tokens
        # Like a forward pass, every scheduled token's KV is written before any of it is read.
        for req_id, computed, n in work:
            state = self.requests[req_id]
            tokens = state.tokens + drafts.get(req_id, [])
            assert n > 0 and computed + n <= len(tokens), (req_id, computed, n)
            if req_id in drafts:
                assert computed == len(state.tokens) - 1, "drafts for a request mid-prefill"
            for pos in range(computed, computed + n):
                self.kv[self._slot(state, pos)] = (pos, tokens[pos])
            state.num_computed = computed + n
        if so.total_num_scheduled_tokens == 0:
            return worker_pb2.ModelRunnerOutput()
        self.parked = [(r, self.requests[r].num_computed
                        == len(self.requests[r].tokens) + len(drafts.get(r, [])),
                        drafts.get(r, [])) for r, _, _ in work]
        return None

    def sample_tokens(self, grammar_output: worker_pb2.GrammarOutput | None
                      ) -> worker_pb2.ModelRunnerOutput:
        out = worker_pb2.ModelRunnerOutput()
        parked, self.parked = self.parked or [], None
        for req_id, complete, drafts in parked:
            out.req_ids.append(req_id)
            entry = out.sampled_token_ids.add()
            if complete:  # rows still mid-prefill are discarded
                state = self.requests[req_id]
                num_tokens = len(state.tokens)
                seen = [self._read(state, pos) for pos in range(num_tokens + len(drafts))]
                for j in range(len(drafts) + 1):
                    token = self.next_token(seen[:num_tokens + j], self.vocab_size)
                    entry.ids.append(token)
                    if j == len(drafts) or drafts[j] != token:
                        break  # the bonus token, or the correction of a rejected draft
                state.tokens.extend(entry.ids)
                state.num_computed = len(state.tokens) - 1  # the last token's KV is not written
        return out

    def _slot(self, state: _State, pos: int) -> int:
        block_id = state.block_ids[pos // self.block_size]
        assert 0 < block_id < self.num_blocks, f"block id {block_id} handed out"
        return block_id * self.block_size + pos % self.block_size

    def _read(self, state: _State, pos: int) -> int:
        entry = self.kv[self._slot(state, pos)]
        # A stale slot (another position's KV) poisons the output rather than failing here, so
        # that the test's comparison reports it with the request's tokens.
        return -1 if entry is None or entry[0] != pos else entry[1]
