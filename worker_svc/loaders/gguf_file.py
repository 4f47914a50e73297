"""A GGUF file (llama.cpp's format): metadata, and tensors de-quantised to float32.

Tensors are renamed to Hugging Face names so one weight loader serves both formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from worker_svc.model_config import ModelConfig

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


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
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


def _unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two rotary halves (rows 0,h,1,h+1,...);
    # the neox-style rotary here wants them back as two contiguous halves.
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def iter_tensors(reader: gguf.GGUFReader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # llama.cpp's own rope table; rotary.py derives it
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [out, in] float32
        name = _hf_name(tensor.name)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            array = _unpermute_rotary_rows(array, heads)
        # dequantize may return a read-only view of the mapped file: copy it then.
        writable = array if array.flags.writeable else array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(writable))
