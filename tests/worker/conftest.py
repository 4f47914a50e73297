"""Factories for worker tests: tiny random checkpoints of each architecture, and workers."""

from __future__ import annotations

import pytest
import torch
from batchwire.common.worker_config import WorkerConfig

from worker_svc.runner.worker import Worker

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # Wider than the default 0.02 so logits are peaked and greedy choices are not near-ties.
    initializer_range=0.3,
    tie_word_embeddings=False,
)

# transformers' config classes by name, imported only when a checkpoint is written: the rank
# processes the TP and PP tests spawn import this file (through their test module) and would
# otherwise each spend seconds importing transformers, which they never use.
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def save_tiny_checkpoint(directory, architecture: str, **overrides) -> str:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, CONFIG_CLASSES[architecture])(**{**TINY, **overrides})
    if architecture == "qwen3":
        config.head_dim = 16
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """{architecture: checkpoint dir}; llama gets Llama-3 rope scaling and tied embeddings."""
    dirs = {}
    for arch in CONFIG_CLASSES:
        overrides = {}
        if arch == "llama":
            overrides = dict(
                tie_word_embeddings=True,
                rope_scaling={
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                },
            )  # fmt: skip
        dirs[arch] = save_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
    return dirs


def tiny_worker(path: str, **overrides) -> Worker:
    settings = dict(
        model=path, dtype="float32", block_size=16, kv_cache_memory_bytes=4 << 20,
        max_num_reqs=16, max_model_len=1024, max_num_batched_tokens=1024,
    )  # fmt: skip
    return Worker(WorkerConfig(**{**settings, **overrides}))


@pytest.fixture()
def llama_worker(tiny_checkpoints) -> Worker:
    return tiny_worker(tiny_checkpoints["llama"])
