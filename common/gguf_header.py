"""The header of a GGUF file: its metadata and its tensor table (names, shapes, types, offsets).

gguf.GGUFReader parses every element of every array into numpy (the tokenizer's 49,152 tokens and
merges), which takes about 9 s for the embedded SmolLM2 on a loaded 2-core machine; the server
needs a few scalar keys, and the worker those and the tensor table (worker_svc/loaders/gguf_file.py
maps the data itself), so this reader skips the arrays, keeping only their lengths. Layout (GGUF
v2/v3, little-endian): magic, version, tensor count, metadata count, the metadata (key, type,
value), then per tensor: name, dims, type, offset; the tensors' data starts at the
next multiple of `general.alignment` (32 by default) after the header.
"""

from __future__ import annotations

import dataclasses
import struct
from collections import Counter
from typing import Any, BinaryIO

# Metadata value types of the GGUF specification -> struct format (scalars only).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor storage types by their GGUF number (ggml_type), the ones a checkpoint commonly holds.
TENSOR_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
                30: "BF16"}
# Bits per weight of the quantised types (blocks of 32 with their scales excluded).
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q2_K": 2, "Q3_K": 3,
              "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_K": 8}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    kind: int  # ggml_type
    offset: int  # from the start of the file


@dataclasses.dataclass(frozen=True, slots=True)
class GgufHeader:
    metadata: dict[str, Any]  # scalar and string values; arrays are left out
    array_lengths: dict[str, int]  # the arrays' keys, with their number of elements
    tensors: list[TensorInfo]

    @property
    def tensor_types(self) -> Counter[str]:
        """Storage type -> number of tensors."""
        return Counter(TENSOR_TYPES.get(t.kind, f"type {t.kind}") for t in self.tensors)

    def describe_weights(self, dtype: str, served: str = "") -> str:
        """E.g. 'GGUF, 4-bit Q4_1 (210 of 272 tensors; also F32, Q8_0), de-quantised to
        bfloat16'; `served` (worker_svc/quant) replaces what follows the stored types."""
        total = sum(self.tensor_types.values())
        main, count = self.tensor_types.most_common(1)[0] if total else ("none", 0)
        bits = QUANT_BITS.get(main)
        others = sorted(t for t in self.tensor_types if t != main)
        also = f"; also {', '.join(others)}" if others else ""
        kind = f"{bits}-bit {main}" if bits else main
        served = served or (f"de-quantised to {dtype}" if bits else f"served in {dtype}")
        return f"GGUF, {kind} ({count} of {total} tensors{also}), {served}"


def read_gguf_header(path: str) -> GgufHeader:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        metadata: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = _string(f)
            value = _value(f, struct.unpack("<I", f.read(4))[0])
            if isinstance(value, _Skipped):
                array_lengths[key] = value.length
            else:
                metadata[key] = value
        entries = []
        for _ in range(n_tensors):
            name = _string(f)
            n_dims = struct.unpack("<I", f.read(4))[0]
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = struct.unpack("<IQ", f.read(12))
            entries.append((name, dims, kind, offset))
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        start = -(-f.tell() // alignment) * alignment
    tensors = [TensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in entries]
    return GgufHeader(metadata, array_lengths, tensors)


@dataclasses.dataclass(frozen=True, slots=True)
class _Skipped:
    """An array's value, not read: only its length."""
    length: int


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(struct.calcsize("<" + _SCALARS[item]) * count, 1)
        else:
            for _ in range(count):
                _value(f, item)
        return _Skipped(count)
    raise ValueError(f"unknown GGUF metadata type {kind}")
