"""Sampling defaults from the model's own generation config (vLLM's `--generation-config auto`).

A request's unset sampling field takes the model's value where the model has one, else
SamplingParams' own default; a field the request sets always wins. Where the values come from:

- a checkpoint directory: its `generation_config.json` (Hugging Face's names; `max_new_tokens`
  becomes max_tokens). As in vLLM, `do_sample` is not read: the values apply as given.
- a GGUF file: its `general.sampling.*` metadata (llama.cpp's names).
- the embedded SmolLM2: its GGUF carries none and its package ships no generation config, so
  batchwire sets greedy decoding (temperature 0). Measured on the 4-bit file, float32, asked
  "What is the capital of France?" through its chat template: the first token's probabilities are
  flat ("The" 0.15, "L" 0.14, "La" 0.10), so at the model card's example settings (temperature
  0.2, top_p 0.9) 25 of 40 seeds answered Paris, and at temperature 1 it drifts ("La capital
  d'Allemagne, paris..."); greedy answers "The capital of France is Paris."

`--generation-config none` keeps SamplingParams' defaults; a path reads that folder's (or that
file's) generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from batchwire.common.gguf_header import read_gguf_header
from batchwire.common.model_files import DEFAULT_MODEL_NAME, default_model_path

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.sampling_params import SamplingParams

MODES = ("auto", "none")  # or a path
# The fields a generation config may set, each with its SamplingParams name.
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
REPORTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
EMBEDDED_MODEL_DEFAULTS = {"temperature": 0.0}


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationConfig:
    defaults: dict[str, Any]  # SamplingParams field -> the model's value; empty = none
    source: str  # where they came from, for GetModelInfo and the logs

    def apply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The request's fields over the model's defaults."""
        return {**self.defaults, **fields}

    def in_force(self) -> dict[str, Any]:
        """Every reported field's default as a request that sets none of them gets it."""
        params = SamplingParams(**self.defaults)
        return {name: getattr(params, name) for name in REPORTED}


def load_generation_config(model: str | None, mode: str = "auto") -> GenerationConfig:
    """The defaults for `model` (None = the embedded SmolLM2); ValueError naming the file when
    its values are not valid sampling parameters."""
    if mode == "none":
        return GenerationConfig({}, "none (--generation-config none): batchwire's defaults")
    if mode != "auto":
        return _checked(_from_json(mode))
    if model is None or os.path.abspath(model) == default_model_path():
        return GenerationConfig(dict(EMBEDDED_MODEL_DEFAULTS),
                                f"batchwire's for the embedded 4-bit {DEFAULT_MODEL_NAME}: greedy "
                                "(it ships no generation config, and sampled it answers simple "
                                "questions at random)")
    if model.endswith(".gguf"):
        metadata = read_gguf_header(model).metadata
        found = {ours: metadata[key] for key, ours in GGUF_KEYS.items() if key in metadata}
        return _checked(GenerationConfig(found, f"{model} general.sampling.*" if found else
                                         f"none in {model}: batchwire's defaults"))
    if os.path.isfile(os.path.join(model, "generation_config.json")):
        return _checked(_from_json(model))
    return GenerationConfig({}, f"none in {model}: batchwire's defaults")


def _from_json(path: str) -> GenerationConfig:
    file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--generation-config: {file} does not hold a JSON object")
    found = {ours: data[key] for key, ours in HF_KEYS.items() if data.get(key) is not None}
    return GenerationConfig(found, file)


def _checked(config: GenerationConfig) -> GenerationConfig:
    try:
        SamplingParams(**config.defaults)
    except InvalidRequestError as e:
        raise ValueError(f"the generation config in {config.source}: {e}") from None
    return config
