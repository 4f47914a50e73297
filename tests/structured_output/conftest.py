"""Structured-output tests on the embedded SmolLM2 (loaded once per session, tests/conftest.py):
the offline API on the shared float32 worker, and constraint factories."""

from __future__ import annotations

import pytest

from scheduler_svc import LLM
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executors.uni import UniProcExecutor
from tests.services.conftest import one_torch_thread  # noqa: F401 - autouse: here and in servers

# Nested object, enum, integer bounds, required fields; bounded strings keep outputs short.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
DATE_REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
COLOURS = ["red", "green", "blue", "dark purple"]


@pytest.fixture(scope="package")
def so_llm(default_worker, default_tokenizer):
    """The offline API on the session's float32 worker, which it leaves empty for the next user."""
    limits = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024)
    default_worker.reset()
    executor = UniProcExecutor(SchedulerConfig(**limits), default_worker)
    yield LLM(executor=executor, tokenizer=default_tokenizer, **limits)
    default_worker.reset()


def chat(tokenizer, question: str) -> str:
    """The chat template's prompt for one user turn."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
