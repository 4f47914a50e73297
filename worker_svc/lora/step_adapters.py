"""A step's adapters: checked (and read from disk) before the batch changes, then given slots.

A request whose adapter cannot be served is refused by name (InvalidStepError with its req_id),
so the scheduler fails that request alone and sends the step again without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from batchwire.common.lora_config import LoRAAdapterError
from batchwire.v1 import worker_pb2

from worker_svc.batch.input_batch import CachedRequestState
from worker_svc.batch.validation import InvalidStepError
from worker_svc.lora.slots import LoRASlots
from worker_svc.models.lora_linear import slot_mask


def load_step_adapters(
    slots: LoRASlots | None,
    so: worker_pb2.SchedulerOutput,
    cached_req_ids: list[str],
    held: Mapping[str, CachedRequestState],
) -> None:
    """Reads every adapter the step needs into the host cache; `held`: the requests the worker
    holds (validation has checked that every cached request is among them)."""
    needed: dict[str, tuple[int, str, str]] = {}  # req_id -> (lora id, path, name)
    for new in so.scheduled_new_reqs:
        if new.lora.id:
            needed[new.req_id] = (new.lora.id, new.lora.path, new.lora.name)
    if slots is None:
        if needed:
            raise InvalidStepError(
                "this worker serves no LoRA adapters (start it with --max-loras N), "
                f"asked for {sorted({name for _, _, name in needed.values()})}",
                list(needed),
            )
        return
    for req_id in cached_req_ids:
        lora_id = held[req_id].lora_id
        if lora_id and lora_id not in slots.slot_of:
            needed[req_id] = (lora_id, slots.paths.get(lora_id, ""), str(lora_id))
    refused, reasons = [], []
    for req_id, (lora_id, path, name) in needed.items():
        try:
            slots.load(lora_id, path)
        except LoRAAdapterError as e:
            refused.append(req_id)
            reasons.append(f"lora_path of adapter {name!r}: {e}")
    if refused:
        raise InvalidStepError("; ".join(dict.fromkeys(reasons)), refused)
    step_ids = {lora_id for lora_id, _, _ in needed.values()}
    step_ids.update(held[r].lora_id for r in cached_req_ids)
    step_ids.discard(0)
    if len(step_ids) > slots.max_loras:
        newcomers = [r for r in needed if r not in set(cached_req_ids)]
        raise InvalidStepError(
            f"the step uses {len(step_ids)} LoRA adapters, more than max_loras {slots.max_loras}",
            newcomers,
        )


def token_slot_mask(
    slots: LoRASlots | None,
    row_lora_ids: np.ndarray,
    req_indices: np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """row_lora_ids [reqs] (0 = base), req_indices [tokens] -> the step's one-hot
    (tokens, max_loras) slot mask, placing adapters in slots as needed; None: base only."""
    if slots is None or not row_lora_ids.any():
        return None
    used = np.unique(row_lora_ids[row_lora_ids > 0])
    slot_of = slots.acquire(used.tolist())
    lookup = np.full(int(used.max()) + 1, -1, dtype=np.int64)  # lora id -> slot
    lookup[used] = [slot_of[i] for i in used.tolist()]
    token_slots = torch.from_numpy(lookup[row_lora_ids][req_indices])  # [tokens]
    return slot_mask(token_slots.to(device), slots.max_loras, dtype)
