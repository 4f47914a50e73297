"""--task embed: the runner's pooled vectors against transformers' final hidden states.

transformers' AutoModel (LlamaModel and kin) returns last_hidden_state after the final norm, which
is what the worker pools. Inputs are prefilled in chunks smaller than the longest input, so its
vector is pooled across steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from batchwire.v1 import worker_pb2 as pb

from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import StepDriver
from worker_svc.batch.validation import InvalidStepError
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.worker import Worker

TINY_INPUTS = {"short": [7, 3, 11], "mid": list(range(40, 61)), "long": list(range(100, 170))}


def runner_for(worker: Worker, pooling_type: str) -> ModelRunner:
    """A fresh runner over the worker's model and KV cache, pooling as asked."""
    config = dataclasses.replace(worker.config, task="embed", pooling_type=pooling_type)
    return ModelRunner(config, worker.model, worker.num_blocks)


def embed_all(
    runner: ModelRunner, inputs: dict[str, list[int]], chunk: int, pooling=None
) -> dict[str, np.ndarray]:
    """Runs the inputs to completion, `chunk` tokens per request per step; {id: vector}."""
    driver = StepDriver(runner, runner.limits.num_blocks, runner.config.block_size, chunk=chunk)
    for req_id, tokens in inputs.items():
        driver.add(req_id, tokens, max_tokens=0)
    vectors: dict[str, np.ndarray] = {}
    for _ in range(100):
        if not driver.active:
            return vectors
        so = driver.build_step()
        if pooling is not None:
            for new in so.scheduled_new_reqs:
                new.pooling.CopyFrom(pooling)
        out = runner.execute_model(so)
        assert out is not None and runner.execute_model_state is None, "a pooling step parks"
        assert list(out.req_ids) == list(runner.input_batch.req_ids[: len(out.req_ids)])
        for req_id, entry, sampled in zip(
            out.req_ids, out.pooler_output, out.sampled_token_ids, strict=True
        ):
            req = driver.active[req_id]
            req.computed = min(req.computed + chunk, len(req.prompt))
            assert not sampled.ids
            if entry.values:
                assert req.computed == len(req.prompt), f"{req_id} pooled before its input ended"
                vectors[req_id] = np.asarray(entry.values, dtype=np.float32)
                del driver.active[req_id]
                driver.free_blocks.extend(req.blocks)
                driver.finished_since_last_step.append(req_id)
    raise AssertionError(f"inputs still active: {list(driver.active)}")


def reference(hf_model, tokens: list[int], pooling_type: str) -> np.ndarray:
    with torch.no_grad():
        hidden = hf_model(torch.tensor([tokens])).last_hidden_state[0]  # (T, hidden)
    pooled = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling_type]
    return F.normalize(pooled.float(), dim=0).numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def tiny_embedder(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return tiny_worker(path, task="embed"), hf


@pytest.mark.parametrize("pooling_type", ["mean", "last", "cls"])
def test_tiny_model_matches_transformers(tiny_embedder, pooling_type):
    worker, hf = tiny_embedder
    vectors = embed_all(runner_for(worker, pooling_type), TINY_INPUTS, chunk=16)
    assert set(vectors) == set(TINY_INPUTS)
    for req_id, tokens in TINY_INPUTS.items():
        expected = reference(hf, tokens, pooling_type)
        assert vectors[req_id].shape == (64,)
        assert np.linalg.norm(vectors[req_id]) == pytest.approx(1.0, abs=1e-5)
        assert cosine(vectors[req_id], expected) >= 0.9999, f"{pooling_type} {req_id}"


def test_chunking_does_not_change_the_vector(tiny_embedder):
    worker, _ = tiny_embedder
    whole = embed_all(runner_for(worker, "mean"), TINY_INPUTS, chunk=1000)
    chunked = embed_all(runner_for(worker, "mean"), TINY_INPUTS, chunk=7)
    for req_id in TINY_INPUTS:
        np.testing.assert_allclose(chunked[req_id], whole[req_id], atol=1e-5)


def test_pooling_params_truncate_and_skip_normalising(tiny_embedder):
    worker, hf = tiny_embedder
    pooling = pb.PoolingParams(dimensions=16, normalize=False)
    vectors = embed_all(runner_for(worker, "last"), TINY_INPUTS, chunk=16, pooling=pooling)
    for req_id, tokens in TINY_INPUTS.items():
        with torch.no_grad():
            raw = hf(torch.tensor([tokens])).last_hidden_state[0, -1, :16].numpy()
        np.testing.assert_allclose(vectors[req_id], raw, rtol=1e-4, atol=1e-4)


def test_bad_pooling_steps_are_refused_untouched(tiny_embedder):
    worker, _ = tiny_embedder
    runner = runner_for(worker, "mean")
    too_wide = pb.SchedulerOutput(total_num_scheduled_tokens=3)
    too_wide.scheduled_new_reqs.add(
        req_id="w", prompt_token_ids=[1, 2, 3], block_ids=[1], num_scheduled_tokens=3,
        pooling=pb.PoolingParams(dimensions=65),
    )  # fmt: skip
    with pytest.raises(InvalidStepError, match="dimensions=65"):
        runner.execute_model(too_wide)
    # Tokens from a prefix cache were never run here: a mean cannot include them.
    cached = pb.SchedulerOutput(total_num_scheduled_tokens=1)
    cached.scheduled_new_reqs.add(
        req_id="p", prompt_token_ids=[1] * 17, block_ids=[1, 2], num_computed_tokens=16,
        num_scheduled_tokens=1,
    )  # fmt: skip
    with pytest.raises(InvalidStepError, match="prefix caching"):
        runner.execute_model(cached)
    assert runner.requests == {} and runner.input_batch.num_reqs == 0


def test_servicer_answers_a_pooling_step_at_once(tiny_embedder):
    from worker_svc.server.servicer import WorkerServicer

    worker, _ = tiny_embedder
    worker.runner.reset()
    servicer = WorkerServicer(worker)
    so = pb.SchedulerOutput(total_num_scheduled_tokens=5)
    so.scheduled_new_reqs.add(
        req_id="e", prompt_token_ids=[4, 5, 6, 7, 8], block_ids=[1], num_scheduled_tokens=5
    )
    reply = pb.ExecuteModelResponse.FromString(servicer.run("ExecuteModel", so))
    assert reply.HasField("output") and len(reply.output.pooler_output[0].values) == 64
    info = worker.get_info()
    assert (info.task, info.pooling_type, info.hidden_size, info.normalize) == (
        "embed", "last", 64, True,
    )  # fmt: skip
    # Not expected after a pooling step; if it comes, it is the no-parked-state branch.
    assert servicer.run("SampleTokens", pb.GrammarOutput()) == b""
    worker.runner.reset()


@pytest.mark.parametrize("pooling_type", ["mean", "last"])
def test_default_model_matches_transformers(
    default_worker, hf_default_model, default_tokenizer, pooling_type
):
    """On the session's default-model worker (the weights do not depend on the task): a pooling
    runner of its own over them, so the suite loads the default model once, not twice."""
    texts = [
        "The capital of France is Paris.",
        "def add(a, b):\n    return a + b",
        "Embeddings map text to vectors. " * 12,  # ~100 tokens: chunked at 32 per step
    ]
    inputs = {f"t{i}": default_tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    assert len(inputs["t2"]) > 64
    vectors = embed_all(runner_for(default_worker, pooling_type), inputs, chunk=32)
    for req_id, tokens in inputs.items():
        expected = reference(hf_default_model.model, tokens, pooling_type)
        assert vectors[req_id].shape == (576,)
        assert cosine(vectors[req_id], expected) >= 0.9999, f"{pooling_type} {req_id}"
