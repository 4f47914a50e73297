"""The worker's GGUF reading against the `gguf` package's own reader: the same metadata, tensor
names, types and stored bytes, for plain and block-quantised types and a non-default alignment
(the worker reads the header itself: gguf.GGUFReader takes seconds on a tokenizer's arrays)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from worker_svc.loaders.gguf_file import GgufFile


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensors_and_metadata_match_the_gguf_package(tmp_path, alignment):
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_token_list([f"t{i}" for i in range(300)])  # skipped, but its length is kept
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        weights = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, reference = GgufFile.open(path), gguf.GGUFReader(path)
    assert ours.header.metadata["llama.block_count"] == 2
    assert ours.header.metadata["general.alignment"] == alignment
    assert ours.header.metadata["llama.rope.freq_base"] == 10000.0
    assert ours.header.array_lengths["tokenizer.ggml.tokens"] == 300
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert [t.name for t in ours.header.tensors] == [t.name for t in reference.tensors]
    for info, expected in zip(ours.header.tensors, reference.tensors, strict=True):
        assert info.kind == expected.tensor_type
        data = ours.tensor_data(info, mapped)
        assert data.dtype == expected.data.dtype and data.shape == expected.data.shape
        assert np.array_equal(data, expected.data), info.name
        assert np.array_equal(gguf.quants.dequantize(data, expected.tensor_type),
                              gguf.quants.dequantize(expected.data, expected.tensor_type))
