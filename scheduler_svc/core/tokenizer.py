"""The tokenizer of a model file: from inside a .gguf file, or from a checkpoint directory."""

from __future__ import annotations

import os
from typing import Any

from batchwire.common.model_files import resolve_model_path


def load_tokenizer(model: str | None) -> Any:
    """A Hugging Face tokenizer for `model` (None = the embedded SmolLM2); nothing is downloaded."""
    from transformers import AutoTokenizer  # slow import, only where a tokenizer is wanted

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        # transformers rebuilds the tokenizer and chat template from the GGUF metadata (~3 s).
        folder, name = os.path.split(path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)
