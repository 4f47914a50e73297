"""Which adapters the worker holds: up to max_loras in the model's slots, more on the host.

An adapter is known by its id (> 0; 0 is the base model) and the path it was read from. Its
host copy (float32) is kept in an LRU of max_cpu_loras; its slot, once given, stays until
another adapter needs the slot and it is the least recently used one that no row of the batch
uses. An adapter whose host copy was dropped is read again from its path.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

from batchwire.common.lora_config import LoRAAdapterError

from worker_svc.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from worker_svc.models.llama import DecoderLayer, LlamaForCausalLM

_FUSED_PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots:
    def __init__(
        self, model: LlamaForCausalLM, max_loras: int, max_rank: int, max_cpu_loras: int
    ) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        model.enable_lora(max_loras, max_rank)
        self.paths: dict[int, str] = {}  # every adapter id seen -> its folder
        self.host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        self.free_slots = list(range(max_loras))

    def load(self, lora_id: int, path: str) -> None:
        """Reads the adapter into the host cache unless it is there; raises LoRAAdapterError.

        An id keeps the path it was first loaded from: another path under the same id is
        refused rather than silently serving the old weights."""
        if lora_id <= 0:
            raise LoRAAdapterError(f"lora id must be positive, got {lora_id}")
        known = self.paths.get(lora_id)
        if known is not None and path and path != known:
            raise LoRAAdapterError(
                f"lora id {lora_id} is loaded from {known!r}, not {path!r}; unload it first"
            )
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
            return
        adapter = load_peft_adapter(lora_id, known or path, self.model.config, self.max_rank)
        self.paths[lora_id] = adapter.path
        self.host[lora_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def acquire(self, lora_ids: Collection[int]) -> dict[int, int]:
        """{id: slot} for the step's adapters (each loaded before), placing those that hold no
        slot into free or least recently used slots outside `lora_ids`."""
        if len(lora_ids) > self.max_loras:
            raise LoRAAdapterError(
                f"a step uses {len(lora_ids)} adapters, more than --max-loras {self.max_loras}"
            )
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            if self.free_slots:
                slot = self.free_slots.pop(0)
            else:
                victim = next(i for i in self.slot_of if i not in lora_ids)
                slot = self.slot_of.pop(victim)
            self.load(lora_id, self.paths[lora_id])
            self._write(slot, self.host[lora_id])
            self.slot_of[lora_id] = slot
        return {lora_id: self.slot_of[lora_id] for lora_id in lora_ids}

    def remove(self, lora_id: int) -> None:
        """Forgets the adapter (its slot is freed, not cleared: no row may point at it now)."""
        self.paths.pop(lora_id, None)
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for index, layer in self.model.layers.items():
            layer_idx = int(index)
            decoder = layer if isinstance(layer, DecoderLayer) else None
            assert decoder is not None
            attn, mlp = decoder.self_attn, decoder.mlp
            stacks = {
                "qkv": attn.qkv_lora, "o": attn.o_lora,
                "gate_up": mlp.gate_up_lora, "down": mlp.down_lora,
            }  # fmt: skip
            for fused, stack in stacks.items():
                assert stack is not None, "enable_lora() ran in __init__"
                parts = [adapter.weights.get((layer_idx, p)) for p in _FUSED_PARTS[fused]]
                stack.set_slot(slot, parts)
