"""A LoRA adapter folder's adapter_config.json, checked the same way by the server (when an
adapter is loaded, no torch here) and by the worker (before it reads the weights).

Only plain LoRA on the attention and MLP projections is served: DoRA, trained biases, extra
trained modules and per-module ranks are refused with the field named.
"""

from __future__ import annotations

import json
import os
from typing import Any


class LoRAAdapterError(ValueError):
    """The adapter at a path cannot be served by this model; the message names what is wrong."""


# field -> the values refused
_UNSUPPORTED = {
    "peft_type": lambda v: v not in (None, "LORA"),
    "use_dora": bool,
    "bias": lambda v: v not in (None, "none"),
    "modules_to_save": bool,
    "fan_in_fan_out": bool,
    "rank_pattern": bool,
    "alpha_pattern": bool,
}


def read_adapter_config(path: str, max_rank: int) -> dict[str, Any]:
    """adapter_config.json of the folder at path, checked for what batchwire serves; its rank
    `r` at most max_rank."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"lora_path {path!r} has no adapter_config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"lora_path {path!r}: adapter_config.json is unreadable: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"lora_path {path!r}: adapter_config.json is not an object")
    for field, refused in _UNSUPPORTED.items():
        if refused(config.get(field)):
            raise LoRAAdapterError(
                f"adapter_config.json {field}={config[field]!r} is not supported "
                "(plain LoRA on the attention and MLP projections only)"
            )
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"adapter_config.json {field} must be positive, got {value!r}")
    if config["r"] > max_rank:
        raise LoRAAdapterError(
            f"adapter_config.json r={config['r']} is above --max-lora-rank {max_rank}"
        )
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise LoRAAdapterError(f"lora_path {path!r} has no adapter_model.safetensors")
    return config
