"""A request's LoRA adapter, as the offline API and the server name it.

`LoRARequest(name, id, path)`: the id is the engine's number for the adapter (> 0; the base
model is no adapter), the path a folder in PEFT's format that the worker reads the first time it
meets the id. Two adapters never share an id: an adapter loaded again under its name gets a new
one, so no worker or prefix cache serves the old weights for it.
"""

from __future__ import annotations

import dataclasses

from scheduler_svc.core.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("lora_name", "an adapter needs a name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise InvalidRequestError("lora_int_id", f"must be an int, got {self.lora_int_id!r}")
        if not 0 < self.lora_int_id < 2**31:
            raise InvalidRequestError(
                "lora_int_id", f"must be in [1, 2^31), got {self.lora_int_id}"
            )
        if not self.lora_path:
            raise InvalidRequestError("lora_path", f"adapter {self.lora_name!r} needs a path")

    @property
    def cache_key(self) -> str:
        """What the prefix cache mixes into a request's first block: one adapter's KV is not
        another's."""
        return f"lora:{self.lora_int_id}"
