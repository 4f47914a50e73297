"""A GGUF file (llama.cpp's format): metadata, and tensors de-quantised to float32 (or, for the
block types a CPU kernel serves as they are, their codes and scales: worker_svc/quant).

Tensors are renamed to Hugging Face names so one weight loader serves both formats. The header is
read by common/gguf_header.py, which skips the tokenizer's arrays (gguf.GGUFReader turns each of
their ~100,000 elements into a numpy view: seconds per load); the tensors are views of the mapped
file, de-quantised one at a time by the `gguf` package.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from batchwire.common.gguf_header import GgufHeader, TensorInfo, read_gguf_header

from worker_svc.model_config import ModelConfig
from worker_svc.quant.blocks import NATIVE_KINDS, QuantizedWeight, from_gguf_blocks

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# Types stored as plain numpy arrays; every other type is stored in blocks, read as bytes.
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass
class GgufFile:
    path: str
    header: GgufHeader

    @classmethod
    def open(cls, path: str) -> GgufFile:
        return cls(path, read_gguf_header(path))

    def tensor_data(self, info: TensorInfo, mapped: np.ndarray) -> np.ndarray:
        """The tensor as stored, in numpy's order (the slowest dimension first): values for the
        plain types, rows of bytes for the block types (what gguf.quants.dequantize takes)."""
        kind = gguf.GGMLQuantizationType(info.kind)
        shape = tuple(reversed(info.dims))
        count = int(np.prod(info.dims))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            data = mapped[info.offset:info.offset + count * dtype.itemsize]
            return data.view(dtype).reshape(shape)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        data = mapped[info.offset:info.offset + count * size // block]
        return data.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))


def _field(reader: GgufFile, key: str, default: Any = None) -> Any:
    return reader.header.metadata.get(key, default)


def read_config(reader: GgufFile) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or reader.header.array_lengths[
        "tokenizer.ggml.tokens"]
    has_output = any(t.name == "output.weight" for t in reader.header.tensors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    scaling = None
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute_rotary_rows(w: Any, num_heads: int) -> Any:
    # llama.cpp's converter interleaves each head's two rotary halves (rows 0,h,1,h+1,...);
    # the neox-style rotary here wants them back as two contiguous halves.
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unpermuted(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    return _unpermute_rotary_rows(rows, num_heads).contiguous()


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def iter_tensors(
    reader: GgufFile, cfg: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, [out, in] float32 tensor) per tensor; with keep_quantized, the
    Q4_0/Q4_1/Q8_0 tensors come as their codes and scales instead."""
    mapped = np.memmap(reader.path, dtype=np.uint8, mode="r")
    for tensor in reader.header.tensors:
        if tensor.name == "rope_freqs.weight":  # llama.cpp's own rope table; rotary.py derives it
            continue
        data = reader.tensor_data(tensor, mapped)
        name = _hf_name(tensor.name)
        heads = None
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        if keep_quantized and tensor.kind in NATIVE_KINDS:
            quantized = from_gguf_blocks(data, tensor.kind)
            if heads is not None:
                quantized = quantized.map_rows(functools.partial(_unpermuted, num_heads=heads))
            yield name, quantized
            continue
        array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(tensor.kind))  # [out, in]
        if heads is not None:
            array = _unpermute_rotary_rows(array, heads)
        # dequantize may return a read-only view of the mapped file: copy it then.
        writable = array if array.flags.writeable else array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(writable))

