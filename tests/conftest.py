"""Session-wide fixtures: the embedded default model, loaded once per test session, and a tiny
random Llama checkpoint for tests that need a real model but not its answers."""

from __future__ import annotations

import os

import pytest
import torch
from batchwire.common.model_files import default_model_path

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.3,  # peaked logits: greedy choices are not near-ties
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random two-layer Llama checkpoint (config.json + safetensors), no tokenizer."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def default_model_file() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_file):
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_file)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_default_model(default_model_file):
    """transformers' own reading of the GGUF file, in float32: the parity reference."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def default_worker():
    """The real default model in a float32 worker (the parity tests' dtype)."""
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.worker import Worker

    return Worker(
        WorkerConfig(
            dtype="float32",
            kv_cache_memory_bytes=256 << 20,
            max_num_reqs=32,
            max_model_len=1024,
            max_num_batched_tokens=1024,
        )  # fmt: skip
    )
