"""A LoRA adapter in PEFT's format: adapter_config.json + adapter_model.safetensors in a folder.

Read on the host in float32 and checked (common/lora_config.py, then the base model's shapes)
before any slot is touched, so a bad adapter is refused whole with the field or tensor named.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from batchwire.common.lora_config import LoRAAdapterError, read_adapter_config
from safetensors import safe_open

from worker_svc.model_config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT names a tensor after the module it wraps, under its own prefix (and, in older files, with
# the adapter's name, ".default", before ".weight").
_TENSOR = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_(A|B)(?:\.\w+)?\.weight"
)


@dataclasses.dataclass(slots=True)
class LoRAAdapter:
    lora_id: int
    path: str
    rank: int  # the largest rank over its modules
    # (layer, projection) -> (A [r, in], B [out, r] already scaled by lora_alpha / r)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """projection -> (in_features, out_features) of the base model (no tensor parallelism)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def load_peft_adapter(lora_id: int, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    config = read_adapter_config(path, max_rank)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                match = _TENSOR.fullmatch(name)
                if match is None or match.group(2) not in PROJECTIONS:
                    raise LoRAAdapterError(
                        f"adapter tensor {name!r} is not a LoRA A/B of an attention or MLP "
                        "projection"
                    )
                key = (int(match.group(1)), match.group(2))
                halves.setdefault(key, {})[match.group(3)] = f.get_tensor(name).float()
    except LoRAAdapterError:
        raise
    except Exception as e:  # safetensors raises its own errors for a truncated or foreign file
        raise LoRAAdapterError(
            f"lora_path {path!r}: adapter_model.safetensors is unreadable: {e}"
        ) from e
    shapes = projection_shapes(cfg)
    weights = {}
    for (layer, proj), pair in sorted(halves.items()):
        where = f"adapter layer {layer} {proj}"
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{where}: the base model has {cfg.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[proj]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r) or r > max_rank:
            raise LoRAAdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model's ({fan_out} x {fan_in}) at rank <= {max_rank}"
            )
        weights[(layer, proj)] = (a, b * scaling)
    if not weights:
        raise LoRAAdapterError(f"lora_path {path!r}: adapter_model.safetensors holds no LoRA")
    return LoRAAdapter(lora_id, path, max(a.shape[0] for a, _ in weights.values()), weights)
