"""LoRA adapters made with PEFT: the worker's greedy tokens equal transformers + PEFT's, each
request with its own adapter, adapters and the base model mixed in one batch."""

from __future__ import annotations

import json

import pytest
from batchwire.v1 import worker_pb2 as pb

from tests.lora_adapters import make_adapter, peft_greedy
from tests.parity import assert_greedy_parity
from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import StepDriver, greedy
from worker_svc.batch.validation import InvalidStepError

RANKS = {1: 8, 2: 16, 3: 8, 4: 16}  # lora id -> rank
PROMPTS = {
    "base": [(7 * i + 3) % 500 for i in range(19)],
    "a1": [(11 * i + 1) % 500 for i in range(7)],
    "a2": [(13 * i + 2) % 500 for i in range(33)],
    "a3": [(17 * i + 9) % 500 for i in range(12)],
    "a4": [(5 * i + 4) % 500 for i in range(26)],
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[int, str]:
    base = tiny_checkpoints["llama"]
    return {
        i: make_adapter(base, tmp_path_factory.mktemp(f"lora{i}"), rank, i)
        for i, rank in RANKS.items()
    }


@pytest.fixture(scope="module")
def references(tiny_checkpoints, adapters) -> dict[str, tuple[object, list[int]]]:
    """req id -> (the transformers model, + PEFT adapter, it ran on; its greedy tokens)."""
    path = tiny_checkpoints["llama"]
    return {
        req_id: peft_greedy(
            path, None if req_id == "base" else adapters[int(req_id[1])], prompt, MAX_TOKENS
        )
        for req_id, prompt in PROMPTS.items()
    }


def lora_ref(lora_id: int, adapters) -> pb.LoRAAdapterRef:
    return pb.LoRAAdapterRef(id=lora_id, name=f"adapter{lora_id}", path=adapters[lora_id])


def run(worker, adapters, groups: list[list[str]], with_lora=True) -> dict[str, list[int]]:
    """Each group of requests runs together (chunked prefill, some joining mid-run)."""
    sampling = greedy()
    sampling.min_tokens = MAX_TOKENS
    sampling.stop_token_ids.append(2)
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=8)
    for group in groups:
        for i, req_id in enumerate(group):
            lora = None if req_id == "base" or not with_lora else lora_ref(int(req_id[1]), adapters)
            driver.add(req_id, PROMPTS[req_id], MAX_TOKENS, sampling, lora)
            if i == 1:
                driver.step()  # the rest join while the first two are mid-prefill
        driver.run()
    return driver.results


def test_four_adapters_and_the_base_in_one_batch_match_peft(tiny_checkpoints, adapters, references):
    worker = tiny_worker(tiny_checkpoints["llama"], max_loras=4, max_lora_rank=16)
    ours = run(worker, adapters, [list(PROMPTS)])
    for req_id, prompt in PROMPTS.items():
        model, ref = references[req_id]
        assert_greedy_parity(model, prompt, ours[req_id], ref)
    # The adapters change the output: without them every request would give the base's tokens.
    base = run(tiny_worker(tiny_checkpoints["llama"]), adapters, [["a1", "a2"]], with_lora=False)
    assert base["a1"] != ours["a1"] and base["a2"] != ours["a2"]


def test_two_slots_serve_four_adapters_in_turn(tiny_checkpoints, adapters, references):
    """max_loras=2: adapters take slots from the least recently used; one host copy dropped."""
    worker = tiny_worker(tiny_checkpoints["llama"], max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    ours = run(worker, adapters, [["a1", "a2", "base"], ["a3", "a4"], ["a1", "a2"]])
    for req_id in ours:
        model, ref = references[req_id]
        assert_greedy_parity(model, PROMPTS[req_id], ours[req_id], ref)
    assert len(worker.runner.lora_slots.host) == 2


def test_an_unservable_adapter_refuses_its_request_only(tiny_checkpoints, adapters, tmp_path):
    worker = tiny_worker(tiny_checkpoints["llama"], max_loras=2, max_lora_rank=8)
    broken = tmp_path / "broken"
    broken.mkdir()
    config = {"r": 8, "lora_alpha": 8, "use_dora": True}
    (broken / "adapter_config.json").write_text(json.dumps(config))
    missing = pb.LoRAAdapterRef(id=7, name="gone", path=str(tmp_path / "nope"))
    cases = {
        "missing": (missing, "no adapter_config.json"),
        "dora": (pb.LoRAAdapterRef(id=8, name="dora", path=str(broken)), "use_dora"),
        "rank": (lora_ref(2, adapters), "r=16 is above --max-lora-rank 8"),
    }  # fmt: skip
    for req_id, (lora, words) in cases.items():
        driver = StepDriver(worker.runner, worker.num_blocks, 16)
        driver.add("fine", PROMPTS["base"], 2)
        driver.add(req_id, PROMPTS["a1"], 2, lora=lora)
        with pytest.raises(InvalidStepError, match=words) as refused:
            driver.step()
        assert refused.value.req_ids == [req_id]
    assert worker.runner.requests == {}  # nothing changed: the step can be sent without them


def test_a_worker_without_slots_refuses_adapter_requests(tiny_checkpoints, adapters):
    worker = tiny_worker(tiny_checkpoints["llama"])
    driver = StepDriver(worker.runner, worker.num_blocks, 16)
    driver.add("a1", PROMPTS["a1"], 2, lora=lora_ref(1, adapters))
    with pytest.raises(InvalidStepError, match="--max-loras") as refused:
        driver.step()
    assert refused.value.req_ids == ["a1"]
