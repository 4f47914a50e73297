"""Session-wide fixtures: the embedded default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from worker_svc.model_files import default_model_path


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
    from worker_svc.config import WorkerConfig
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
