"""Builds the model from a checkpoint directory or a GGUF file; both go through one name map."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from worker_svc.loaders import gguf_file, hf_checkpoint
from worker_svc.model_config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.models.packed_linear import pack_linears, packing_available
from worker_svc.parallel.pipeline import PipelineStage
from worker_svc.parallel.tensor_parallel import TensorParallel
from worker_svc.quant import serve as quant_serve
from worker_svc.quant.blocks import QuantizedWeight

# Hugging Face projections that the model holds fused: (fused name, position in the fusion).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def read_model_config(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        return gguf_file.read_config(gguf_file.GgufFile.open(path))
    return hf_checkpoint.read_config(path)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: str,
    max_position: int,
    tp: TensorParallel | None = None,
    pp: tuple[int, int] = (0, 1),
    quantization: str = "none",
    before_cast: Callable[[LlamaForCausalLM, dict[str, QuantizedWeight]], None] | None = None,
) -> tuple[LlamaForCausalLM, str]:
    """This rank's part of the model: the layers of its pipeline stage `pp` = (pp_rank, pp_size),
    each weight's tensor-parallel shard (all of it without tensor parallelism); and what its
    quantized linear layers serve (quant_serve.describe; "" for none). quantization: the
    resolved mode ("none", "native", "int4", "int8"; WorkerConfig.served_quantization).
    before_cast(model, stored) sees the model still in float32 (its norms as the file stores
    them) with the quantized weights as they are stored: where the native decode step is built."""
    if path.endswith(".gguf"):
        reader = gguf_file.GgufFile.open(path)
        cfg = gguf_file.read_config(reader)
        tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]] = gguf_file.iter_tensors(
            reader, cfg, keep_quantized=quantization != "none")
    else:
        cfg = hf_checkpoint.read_config(path)
        tensors = hf_checkpoint.iter_tensors(path)
    if quantization != "none" and not quant_serve.kernels_available():
        raise ValueError(f"quantization={quantization!r}: this torch has no CPU int4/int8 "
                         "matmul kernels; serve with quantization=none")
    tp = tp or TensorParallel()
    stage = PipelineStage.build(cfg.num_layers, pp[0], pp[1], tp.rank, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position, tp, stage)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_rotary(device)
    stored = load_weights(model, tensors)
    if before_cast is not None:
        before_cast(model, stored)
    model = model.to(dtype).eval().requires_grad_(False)
    served: Counter[str] = Counter()
    packs = packing_available(dtype, device)
    if quantization != "none":
        served = quant_serve.install(model, quantization, stored, dtype, packs)
    if packs:
        pack_linears(model)
    return model, quant_serve.describe(served, str(dtype).removeprefix("torch."))


def load_weights(
    model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
) -> dict[str, QuantizedWeight]:
    """Copies Hugging Face-named tensors into the model, fusing q|k|v and gate|up on the way.
    Quantized tensors are copied de-quantised, and also returned as they are, by model name."""
    params = dict(model.named_parameters())
    parts: dict[str, dict[int, torch.Tensor | QuantizedWeight]] = {}
    stored: dict[str, QuantizedWeight] = {}
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        name = _name_on_stage(model, hf_name.removeprefix("model."))
        if name is None:
            continue
        match = re.fullmatch(r"(.*)\.(\w+_proj)\.(weight|bias)", name)
        if match and match.group(2) in _FUSED:
            prefix, proj, kind = match.groups()
            fused, index = _FUSED[proj]
            name = f"{prefix}.{fused}.{kind}"
            parts.setdefault(name, {})[index] = tensor
            pieces = parts[name]
            if len(pieces) < (3 if fused == "qkv_proj" else 2):
                continue
            tensor = _cat_rows([pieces[i] for i in sorted(pieces)])
            del parts[name]
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        if isinstance(tensor, QuantizedWeight):
            # Quantized serving runs without tensor parallelism (WorkerConfig refuses it).
            assert not model.tp.enabled, "quantized weights are not sharded"
            stored[name] = tensor
            tensor = tensor.dequantize()
        tensor = model.plan.shard(name, tensor, model.config)
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded
    if model.config.tie_word_embeddings and model.embed_tokens is not None:
        missing.discard("lm_head.weight")
    if missing or parts:
        raise ValueError(f"checkpoint lacks tensors: {sorted(missing | set(parts))[:8]}")
    embed, head = model.embed_tokens, model.lm_head
    if "embed_tokens.weight" in stored and embed is not None and head is not None and (
            head.weight is embed.weight):  # tied: the head reads the embedding's codes too
        stored["lm_head.weight"] = stored["embed_tokens.weight"]
    return stored


def _cat_rows(pieces: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """The fused weight: q|k|v or gate|up stacked by rows, in whichever form they came."""
    if all(isinstance(p, QuantizedWeight) for p in pieces):
        return QuantizedWeight.cat_rows([p for p in pieces if isinstance(p, QuantizedWeight)])
    # Parts stored in different forms (a float k beside quantized q, say): all de-quantised.
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in pieces])


def _name_on_stage(model: LlamaForCausalLM, name: str) -> str | None:
    """Where a checkpoint tensor goes on this pipeline stage; None if another stage holds it."""
    tied = model.config.tie_word_embeddings
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer is not None:
        return name if model.stage.holds_layer(int(layer.group(1))) else None
    if name == "embed_tokens.weight":
        if model.embed_tokens is not None:
            return name  # tied to the LM head by tie_weights() when both are here
        # A last stage without the embedding holds its own copy of the tied matrix.
        return "lm_head.weight" if tied and model.lm_head is not None else None
    if name == "lm_head.weight":
        return None if tied or model.lm_head is None else name
    if name == "norm.weight":
        return name if model.norm is not None else None
    return name
