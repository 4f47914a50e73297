"""The tokenizer of a model file: from inside a .gguf file, or from a checkpoint directory.

transformers rebuilds a GGUF file's tokenizer from its metadata (the vocabulary and merges as
arrays of ~50,000 strings each), which takes seconds on every start; loading the same tokenizer
from its saved tokenizer.json takes half a second. So the rebuilt tokenizer is saved once in a
cache folder, under a key made of the file's path, size and modification time and the
transformers version, and loaded from there afterwards. Where the folder cannot be written (a
read-only home), every start rebuilds it, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

from batchwire.common.model_files import cache_root, resolve_model_path

logger = logging.getLogger(__name__)


def load_tokenizer(model: str | None) -> Any:
    """A Hugging Face tokenizer for `model` (None = the embedded SmolLM2); nothing is downloaded."""
    from transformers import AutoTokenizer  # slow import, only where a tokenizer is wanted

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def _cache_key(path: str) -> str:
    import transformers

    stat = os.stat(path)
    what = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, transformers.__version__)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:24]


def _gguf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    cached = os.path.join(cache_root(), "tokenizers", _cache_key(path))
    if os.path.isdir(cached):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged entry: rebuild it below
            logger.warning("the cached tokenizer in %s did not load: rebuilding it", cached,
                           exc_info=True)
            shutil.rmtree(cached, ignore_errors=True)
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _save(tokenizer, cached)
    return tokenizer


def _save(tokenizer: Any, cached: str) -> None:
    """Saved whole or not at all: written beside the entry, then renamed into place (two
    processes that build it at once leave one entry)."""
    parent = os.path.dirname(cached)
    try:
        os.makedirs(parent, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    except OSError as e:
        logger.info("not caching the tokenizer (%s): it is rebuilt on every start", e)
        return
    try:
        tokenizer.save_pretrained(partial)
        os.rename(partial, cached)
    except OSError as e:  # another process saved it first, or the disk is full
        logger.debug("the tokenizer cache entry %s was not written: %s", cached, e)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
