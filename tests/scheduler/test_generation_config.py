"""Sampling defaults from the model's generation config: where they are read from, that a request's
own fields win over them, and that bad values stop the server with the file named. The GGUF
header reader is checked against the gguf package's own reader on a file written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from batchwire.common.gguf_header import read_gguf_header
from batchwire.common.model_files import default_model_path, describe_weights
from batchwire.v1 import generate_pb2

from scheduler_svc import LLM
from scheduler_svc.core.generation_config import load_generation_config
from scheduler_svc.executors.uni import UniProcExecutor
from scheduler_svc.service import wire

from .conftest import ByteTokenizer, make_config
from .fake_worker import FakeWorker, fake_greedy

REPO = Path(__file__).resolve().parents[2]


def checkpoint(tmp_path, **values):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_a_checkpoints_generation_config_sets_the_unset_fields(tmp_path):
    model = checkpoint(tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64,
                       do_sample=True, bos_token_id=1, repetition_penalty=None)
    config = load_generation_config(model)
    assert config.defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert config.source.endswith("generation_config.json")
    unset = wire.sampling_params(generate_pb2.SamplingParams(), config)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.95, 20, 64)
    assert unset.repetition_penalty == 1.0  # not in the file: batchwire's own default
    # The request's fields win, an explicit 0 included.
    own = wire.sampling_params(generate_pb2.SamplingParams(temperature=0, max_tokens=5), config)
    assert (own.temperature, own.top_p, own.max_tokens) == (0.0, 0.95, 5)
    assert config.in_force() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                 "repetition_penalty": 1.0, "max_tokens": 64}


def test_none_keeps_batchwires_defaults_and_a_path_reads_that_file(tmp_path):
    model = checkpoint(tmp_path, temperature=0.6)
    assert load_generation_config(model, "none").defaults == {}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"top_k": 7}))
    assert load_generation_config(model, str(other)).defaults == {"top_k": 7}
    assert load_generation_config(None, str(tmp_path)).defaults == {"temperature": 0.6}
    (tmp_path / "generation_config.json").unlink()
    assert load_generation_config(model).defaults == {}  # a checkpoint without one


def test_bad_values_are_refused_naming_the_file(tmp_path):
    model = checkpoint(tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match=r"generation_config.json: top_p: 1.5 must be in \(0, 1\]"):
        load_generation_config(model)
    with pytest.raises(ValueError, match="cannot read .*missing.json"):
        load_generation_config(model, str(tmp_path / "missing.json"))


def test_the_embedded_model_is_greedy_by_default():
    config = load_generation_config(None)
    assert config.defaults == {"temperature": 0.0}
    assert "embedded 4-bit SmolLM2-135M-Instruct" in config.source
    assert load_generation_config(default_model_path()).defaults == {"temperature": 0.0}
    assert describe_weights(None, "bfloat16") == (
        "GGUF, 4-bit Q4_1 (210 of 272 tensors; also F32, Q8_0), de-quantised to bfloat16")


def write_gguf(path, **sampling) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "a", "b"])  # an array of strings, skipped
    writer.add_token_scores([0.0, -1.0, -2.0])  # an array of numbers, skipped
    for key, value in sampling.items():
        writer.add_float32(f"general.sampling.{key}", value)
    writer.add_tensor("w", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("h", np.zeros((8,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_files_sampling_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, temp=0.7, top_p=0.8, penalty_repeat=1.1)
    header = read_gguf_header(str(path))
    reference = gguf.GGUFReader(str(path))
    assert header.metadata["llama.block_count"] == 2
    assert header.metadata["general.sampling.temp"] == pytest.approx(0.7)
    assert header.tensor_types == {"F32": 1, "F16": 1}
    assert sorted(t.tensor_type.name for t in reference.tensors) == ["F16", "F32"]
    assert "tokenizer.ggml.tokens" not in header.metadata  # arrays are skipped
    assert header.describe_weights("float32") == (
        "GGUF, F32 (1 of 2 tensors; also F16), served in float32")
    config = load_generation_config(str(path))
    assert config.defaults == pytest.approx(
        {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1})
    empty = tmp_path / "plain.gguf"
    write_gguf(empty)
    assert load_generation_config(str(empty)).defaults == {}


def test_the_offline_api_takes_the_defaults_when_given_no_params(tmp_path):
    expected = fake_greedy([5, 6, 7], 3, 64)
    eos = next(t for t in range(64) if t not in expected)
    worker = FakeWorker(num_blocks=40, block_size=4, vocab_size=64, eos_token_ids=(eos,),
                        max_model_len=64)
    letters = ByteTokenizer([bytes([65 + i % 26]) for i in range(63)])
    llm = LLM(model=checkpoint(tmp_path, max_new_tokens=3, temperature=0.0),
              executor=UniProcExecutor(make_config(), worker), tokenizer=letters,
              max_model_len=64, block_size=4)
    assert llm.default_sampling_params().max_tokens == 3
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert out.token_ids == expected  # greedy, and 3 tokens: the checkpoint's max_new_tokens


def test_serve_refuses_a_bad_generation_config_in_one_line(tmp_path):
    bad = tmp_path / "generation_config.json"
    bad.write_text(json.dumps({"temperature": -1}))
    done = subprocess.run([sys.executable, "-m", "scheduler_svc.cli", "serve", "--port", "0",
                           "--no-metrics", "--generation-config", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"batchwire: the generation config in {bad}: temperature: -1 "
                                   "must be finite and >= 0"), done.stderr
