"""batchwire: `from batchwire import LLM, SamplingParams` is the offline API's front door.

The names are looked up on first use, so importing the generated protobuf code (`batchwire.v1`) or
what both services share (`batchwire.common`) never loads the engine or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "LLM": "scheduler_svc.engine.llm",
    "SamplingParams": "scheduler_svc.core.sampling_params",
    "LoRARequest": "scheduler_svc.core.lora_request",
    "RequestOutput": "scheduler_svc.core.outputs",
    "SchedulerConfig": "scheduler_svc.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchwire' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
