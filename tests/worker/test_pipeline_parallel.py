"""PP=2 and PP=2 x TP=2 on CPU (gloo): ranks driven with the same steps give PP=1's greedy tokens.

Each rank is a process holding a Worker behind a WorkerServicer, fed by its own StepDriver. The
drivers stay in step the way a scheduler's executor keeps ranks in step: every rank answers every
call, and the output rank's reply (TP rank 0 of the last stage) is the one all drivers apply.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import grpc
import pytest
from batchwire.v1 import worker_pb2 as pb

from tests.worker.conftest import save_tiny_checkpoint
from tests.worker.step_driver import StepDriver, greedy

# Lengths and output counts differ so that, with chunk=16, steps mix prefill chunks with decodes
# and requests finish at different steps; "late" joins after a few steps.
PROMPTS = {"a": [5, 17, 29, 41, 53, 65, 77], "b": list(range(100, 137)), "c": [300, 2, 9]}
MAX_TOKENS = {"a": 12, "b": 5, "c": 9, "late": 6}
LATE_PROMPT = list(range(200, 221))
JOIN_AT_STEP = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sampling_for(req_id: str) -> pb.RequestSamplingParams:
    sampling = greedy()
    sampling.min_tokens = MAX_TOKENS[req_id]  # no early EOS: every request runs its full length
    sampling.stop_token_ids.append(2)
    return sampling


class PipelineStepDriver(StepDriver):
    """Also tells every rank each request's tokens sampled since it was last scheduled: only the
    last stage samples, and the others need them for their next inputs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.told: dict[str, int] = {}  # output tokens the workers have heard of, per request

    def build_step(self) -> pb.SchedulerOutput:
        so = super().build_step()
        for new in so.scheduled_new_reqs:
            self.told[new.req_id] = len(new.output_token_ids)
        for req_id in so.scheduled_cached_reqs.req_ids:
            output = self.active[req_id].output
            so.cached_new_token_ids.add().ids.extend(output[self.told[req_id] :])
            self.told[req_id] = len(output)
        return so


class GroupMember:
    """One rank as the driver sees it: calls go through the servicer, replies are shared."""

    def __init__(self, servicer, output_rank: int, empty_replies: list[str]) -> None:
        self.servicer = servicer
        self.output_rank = output_rank
        self.empty_replies = empty_replies  # what this rank answered without an output, per call

    def _shared(self, reply: pb.ModelRunnerOutput | None) -> pb.ModelRunnerOutput | None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return reply
        box = [None if reply is None else reply.SerializeToString()]
        dist.broadcast_object_list(box, src=self.output_rank)
        return None if box[0] is None else pb.ModelRunnerOutput.FromString(box[0])

    def execute_model(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput | None:
        reply = pb.ExecuteModelResponse.FromString(self.servicer.run("ExecuteModel", so))
        output = reply.output if reply.HasField("output") else None
        if output is not None and not output.req_ids and so.total_num_scheduled_tokens:
            self.empty_replies.append("ExecuteModel")
        return self._shared(output)

    def sample_tokens(self, grammar: pb.GrammarOutput | None) -> pb.ModelRunnerOutput:
        request = grammar or pb.GrammarOutput()
        output = pb.ModelRunnerOutput.FromString(self.servicer.run("SampleTokens", request))
        if not output.req_ids:
            self.empty_replies.append("SampleTokens")
        shared = self._shared(output)
        assert shared is not None
        return shared


def run_rank(model, rank, pp, tp, init_method, results):
    import torch
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.runner.worker import Worker

    torch.set_num_threads(1)  # up to four ranks share the machine's cores
    config = WorkerConfig(
        model=model, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_reqs=8,
        max_model_len=256, max_num_batched_tokens=256, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, rank=rank, distributed_init_method=init_method,
    )  # fmt: skip
    results.put((rank, drive_rank(Worker(config), rank)))
    # Leave the group together: a rank that exits while its peer's gloo threads still talk to it
    # can die in C++ teardown ("terminate called without an active exception", SIGABRT; once in
    # a fresh-clone run) although its results were sent.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def drive_rank(worker, rank: int) -> dict:
    """Every step through this rank's servicer, the output rank's replies applied; what the
    rank saw."""
    import torch

    from worker_svc.server.servicer import WorkerCallError, WorkerServicer

    config = worker.config
    servicer = WorkerServicer(worker, is_output_rank=rank == config.output_rank)
    empty: list[str] = []
    member = GroupMember(servicer, config.output_rank, empty)
    # Every rank sizes its free list by the group's smallest pool, as the scheduler will.
    blocks = torch.tensor([worker.num_blocks])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
    driver = PipelineStepDriver(member, int(blocks), 16, chunk=16)
    for r, p in PROMPTS.items():
        driver.add(r, p, MAX_TOKENS[r], sampling_for(r))
    for _ in range(JOIN_AT_STEP):
        driver.step()
    driver.add("late", LATE_PROMPT, MAX_TOKENS["late"], sampling_for("late"))
    out = driver.run()
    # A SampleTokens with no ExecuteModel before it: refused on the output rank only.
    try:
        again = pb.ModelRunnerOutput.FromString(servicer.run("SampleTokens", pb.GrammarOutput()))
        second_sample = "OK" if not again.req_ids else "tokens"
    except WorkerCallError as e:
        second_sample = e.code.name
    kv_layers = [a.layer_idx for a in worker.model.attention_layers() if a.k_cache is not None]
    info = worker.get_info()
    return dict(
        tokens=out, num_blocks=worker.num_blocks, kv_layers=kv_layers, empty=sorted(set(empty)),
        second_sample=second_sample,
        info=(info.pipeline_parallel_size, info.pp_rank, info.tp_rank, info.output_rank),
    )  # fmt: skip


def single_rank(model: str, worker=None) -> dict:
    """PP=1 x TP=1 in this process (no group to join, so no process of its own), on the ranks'
    settings, or on `worker` (the session's default-model worker, not a second load of it)."""
    if worker is None:
        from tests.worker.conftest import tiny_worker

        worker = tiny_worker(model, kv_cache_memory_bytes=16 << 20, max_num_reqs=8,
                             max_model_len=256, max_num_batched_tokens=256)
    worker.reset()
    return drive_rank(worker, 0)


def generate(model: str | None, pp: int, tp: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=run_rank, args=(model, r, pp, tp, init, results))
        for r in range(pp * tp)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return [got[r] for r in range(pp * tp)]


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory) -> str:
    """An odd layer count: PP=2 splits it 2 + 1, so the stages' KV pools differ."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama3l"), "llama", num_hidden_layers=3)


@pytest.mark.parametrize(("which", "pp", "tp"), [("tiny", 2, 1), ("tiny", 2, 2), ("default", 2, 1)])
def test_pp_matches_pp1(request, tiny_checkpoints, which, pp, tp):
    if which == "tiny":
        model = tiny_checkpoints["llama"]
        single = single_rank(model)
    else:
        model = None
        single = single_rank(model, request.getfixturevalue("default_worker"))
    ranks = generate(model, pp, tp)
    output_rank = (pp - 1) * tp
    for rank, got in enumerate(ranks):
        assert got["info"] == (pp, rank // tp, rank % tp, output_rank)
        # Exact: the same layers in the same order, only split across processes.
        assert got["tokens"] == single["tokens"], f"rank {rank}: PP={pp} x TP={tp} differs"
        if rank // tp < pp - 1:
            # A first stage hands its hidden states on: both its answers are empty outputs.
            assert got["empty"] == ["ExecuteModel", "SampleTokens"], rank
        else:
            assert got["empty"] == [], rank  # the last stage parked and sampled every step
        expected = "FAILED_PRECONDITION" if rank == output_rank else "OK"
        assert got["second_sample"] == expected, rank
    assert set(single["tokens"]) == set(MAX_TOKENS)
    assert {r: len(t) for r, t in single["tokens"].items()} == MAX_TOKENS


def test_uneven_stages_cache_their_own_layers(three_layer_llama):
    single = single_rank(three_layer_llama)
    first, last = generate(three_layer_llama, 2, 1)
    assert (single["kv_layers"], first["kv_layers"], last["kv_layers"]) == ([0, 1, 2], [0, 1], [2])
    # The same 16 MiB spent on 3, 2 and 1 layers' K and V: a block of one layer is K and V of
    # 16 tokens x 2 KV heads x 16 dims in float32.
    layer_block = 2 * 16 * 2 * 16 * 4
    assert single["num_blocks"] == (16 << 20) // (3 * layer_block)
    assert first["num_blocks"] == (16 << 20) // (2 * layer_block)
    assert last["num_blocks"] == (16 << 20) // layer_block
    assert first["tokens"] == last["tokens"] == single["tokens"]


def test_sample_tokens_rules_on_one_worker(llama_worker):
    """TP=1 and PP=1: the only rank is the output rank."""
    from worker_svc.server.servicer import WorkerCallError, WorkerServicer

    servicer = WorkerServicer(llama_worker)
    with pytest.raises(WorkerCallError) as refused:
        servicer.run("SampleTokens", pb.GrammarOutput())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "nothing is parked" in refused.value.message
    # After a step that answered at once, SampleTokens takes the no-parked-state branch, once.
    servicer.run("ExecuteModel", pb.SchedulerOutput(step_id=1))
    assert servicer.run("SampleTokens", pb.GrammarOutput()) == b""
    with pytest.raises(WorkerCallError):
        servicer.run("SampleTokens", pb.GrammarOutput())
    # A non-output rank answers empty whatever came before.
    other = WorkerServicer(llama_worker, is_output_rank=False)
    assert other.run("SampleTokens", pb.GrammarOutput()) == b""
