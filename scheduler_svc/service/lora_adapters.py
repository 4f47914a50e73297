"""The LoRA adapters a server serves, by the name clients use (`--lora-modules NAME=PATH`, the
load and unload calls of both fronts).

Each load gets a fresh id, never reused: an adapter unloaded and loaded again (perhaps from
another path) is a new adapter to the workers and the prefix cache. Unloading takes the name
away at once, so new requests naming it get NOT_FOUND, while the requests already admitted run
to their end with the adapter they started with (their LoRARequest holds its id and path; the
worker drops its copy when the slot is wanted). Nothing is refused or made to wait for them.
"""

from __future__ import annotations

import itertools

from batchwire.common.lora_config import LoRAAdapterError, read_adapter_config

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.lora_request import LoRARequest

MAX_NAME_CHARS = 128


class UnknownAdapterError(LookupError):
    """A request or an unload names no adapter this server serves (NOT_FOUND)."""


class LoRAAdapters:
    def __init__(self, max_loras: int, max_lora_rank: int, base_model_name: str = "") -> None:
        self.max_loras = max_loras  # the workers' slots; 0: the workers serve no adapter
        self.max_lora_rank = max_lora_rank
        self.base_model_name = base_model_name  # a name that means "no adapter"
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRARequest:
        """Checks the name and the adapter's config (not its weights: the worker reads them
        when a request first uses it); raises InvalidRequestError naming the field."""
        if not self.max_loras:
            raise InvalidRequestError(
                "lora_name", "this server's workers serve no LoRA adapters (start it with "
                "--max-loras N)")
        if not name or len(name) > MAX_NAME_CHARS or name == self.base_model_name:
            raise InvalidRequestError(
                "lora_name", f"{name[:MAX_NAME_CHARS]!r}: a name of 1 to {MAX_NAME_CHARS} "
                "characters that is not the base model's")
        if name in self._by_name:
            raise InvalidRequestError(
                "lora_name", f"{name!r} is loaded already (from "
                f"{self._by_name[name].lora_path!r}); unload it first")
        if not path:
            raise InvalidRequestError("lora_path", f"adapter {name!r} needs a path")
        try:
            read_adapter_config(path, self.max_lora_rank)
        except LoRAAdapterError as e:
            raise InvalidRequestError("lora_path", str(e)) from None
        lora = LoRARequest(name, next(self._ids), path)
        self._by_name[name] = lora
        return lora

    def unload(self, name: str, path: str = "") -> LoRARequest:
        """`path`, when given, must be the one the adapter was loaded from."""
        lora = self._by_name.get(name)
        if lora is None:
            raise UnknownAdapterError(f"lora_name {name[:MAX_NAME_CHARS]!r} is not loaded")
        if path and path != lora.lora_path:
            raise InvalidRequestError(
                "lora_path", f"adapter {name!r} was loaded from {lora.lora_path!r}, not {path!r}")
        return self._by_name.pop(name)

    def resolve(self, name: str) -> LoRARequest | None:
        """The adapter a request names; None for "" or the base model's name."""
        if not name or name == self.base_model_name:
            return None
        lora = self._by_name.get(name)
        if lora is None:
            raise UnknownAdapterError(
                f"lora_name {name[:MAX_NAME_CHARS]!r} is not loaded (loaded: "
                f"{sorted(self._by_name)[:16]})")
        return lora

    def listed(self) -> list[LoRARequest]:
        return sorted(self._by_name.values(), key=lambda lora: lora.lora_int_id)
