"""lm-eval against the HTTP API, on tasks defined in this repository over local JSON-lines files
(lm_eval_tasks/; no hub): a log-likelihood task through `local-completions`, whose accuracy and
per-choice log-likelihoods equal lm-eval's own `hf` model type on the same model, and a
generation task through `local-chat-completions`, whose answers equal the gRPC API's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import REPO, collect, greedy
from tests.client_api.test_openai_sdk import MODEL

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "lm_eval_tasks"
TOLERANCE = 2e-3  # the server's float32 model against transformers' float32 reading of it


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    """lm-eval, offline: datasets from local files only, its cache in the test's folder; only
    this repository's tasks indexed (its thousands of built-in ones take a minute)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        patch.chdir(REPO)  # the tasks name their data relative to the repository's root
        import lm_eval
        from lm_eval.tasks import TaskManager

        yield lm_eval, TaskManager(include_path=str(TASKS), include_defaults=False)


def _evaluate(lm_eval, model, name: str, **kwargs) -> tuple[dict, list[dict]]:
    lib, manager = lm_eval
    out = lib.simple_evaluate(model=model, tasks=[name], task_manager=manager, log_samples=True,
                              bootstrap_iters=0, **kwargs)
    return out["results"][name], sorted(out["samples"][name], key=lambda s: s["doc_id"])


def test_log_likelihoods_equal_the_hf_model_type(server, lm_eval, hf_default_model,
                                                 default_tokenizer):
    from lm_eval.models.huggingface import HFLM

    served, served_samples = _evaluate(
        lm_eval, "local-completions", "batchwire_capitals",
        model_args={"model": MODEL, "base_url": f"{server.base_url}/completions",
                    "tokenizer_backend": "remote", "batch_size": 8, "max_retries": 1})
    reference = HFLM(pretrained=hf_default_model, tokenizer=default_tokenizer, batch_size=8)
    hf, hf_samples = _evaluate(lm_eval, reference, "batchwire_capitals")
    assert len(served_samples) == len(hf_samples) == 12
    assert served["acc,none"] == hf["acc,none"]
    assert served["acc,none"] >= 0.5  # the model knows most capitals: the scores mean something
    for ours, theirs in zip(served_samples, hf_samples, strict=True):
        for (ll, _), (ref, _) in zip(ours["filtered_resps"], theirs["filtered_resps"],
                                     strict=True):
            assert math.isclose(ll, ref, abs_tol=TOLERANCE), (ours["doc"], ll, ref)


def test_chat_generation_task_answers_as_grpc_does(server, lm_eval):
    results, samples = _evaluate(
        lm_eval, "local-chat-completions", "batchwire_sums", apply_chat_template=True,
        model_args={"model": MODEL, "base_url": f"{server.base_url}/chat/completions",
                    "tokenizer_backend": "none", "max_retries": 1})
    assert len(samples) == 6
    for sample in samples:
        doc = sample["doc"]
        question = f"What is {doc['a']} plus {doc['b']}? Reply with the number only."
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            sampling=greedy(6, ignore_eos=False, stop=["\n"], seed=1234))
        _, text, _, _ = collect(server.stub.Generate(request, timeout=60))
        assert sample["resps"][0][0] == text, doc
    exact = sum(s["filtered_resps"][0].strip(" .") == s["target"] for s in samples)
    assert results["exact_match,none"] == pytest.approx(exact / len(samples))
