"""Quantized linear weights (worker_svc/quant): GGUF codes served as they are stored, the mode's
rules, and what a worker says it serves."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from batchwire.common.worker_config import WorkerConfig

from tests.worker.conftest import tiny_worker
from tests.worker.step_driver import StepDriver, greedy
from worker_svc.loaders.gguf_file import GgufFile
from worker_svc.models.packed_linear import packing_available
from worker_svc.native.decoder import pack_int4, pack_int8, unpack
from worker_svc.quant.blocks import from_gguf_blocks, quantize_int4, quantize_int8_rows
from worker_svc.quant.linear import QuantLinear, int4_matmul, int4_pack

Q = gguf.GGMLQuantizationType


def unpack_int4(packed: torch.Tensor, scales_zeros: torch.Tensor, k: int) -> torch.Tensor:
    """The [N, K] weight the int4 kernel computes with: the packed form times the identity."""
    eye = torch.eye(k, dtype=scales_zeros.dtype)
    return int4_matmul(eye, packed, scales_zeros, 32).t().float()


def file_tensors(path: str, kind: Q, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    reader = GgufFile.open(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    found = [t for t in reader.header.tensors if t.kind == kind][:count]
    assert found, f"the default model has no {kind.name} tensor"
    return [(reader.tensor_data(t, mapped), gguf.quants.dequantize(
        reader.tensor_data(t, mapped), kind)) for t in found]


def test_q4_1_tensors_unpacked_from_the_int4_packing_equal_gguf_dequantize(default_model_file):
    for data, expected in file_tensors(default_model_file, Q.Q4_1, 3):
        weight = from_gguf_blocks(data, Q.Q4_1)
        ref = torch.from_numpy(expected)
        # float32 scales (fp16 d and m + 8d, exact in float32): equal up to float32 rounding of
        # the kernel's (q - 8) * scale + zero.
        exact = unpack_int4(*int4_pack(weight, torch.float32), weight.shape[1])
        torch.testing.assert_close(exact, ref, rtol=0, atol=1e-6)
        # The served form keeps its scales and zeros in bfloat16 (8 bits of mantissa): each value
        # within the rounding of its group's scale and zero, |q - 8| * ulp(d) / 2 + ulp(z) / 2.
        served = unpack_int4(*int4_pack(weight, torch.bfloat16), weight.shape[1])
        scale = weight.scale.repeat_interleave(32, 1).abs()
        zero = weight.zero.repeat_interleave(32, 1).abs()
        bound = (8 * scale + zero) * 2.0 ** -8 + 2.0 ** -8 * ref.abs()  # + the output's rounding
        assert ((served - ref).abs() <= bound).all()


def test_the_native_steps_form_of_q4_1_and_q8_0_equals_gguf_dequantize(default_model_file):
    """The native decode step (worker_svc/native) computes with unsigned codes, rows in tiles
    of four, and float16 scales per group (w = q * scale + bias for Q4_1, (q - 128) * scale for
    Q8_0): GGUF stores its scales in float16, so the file's values exactly."""
    for data, expected in file_tensors(default_model_file, Q.Q4_1, 3):
        packed = pack_int4(from_gguf_blocks(data, Q.Q4_1))
        assert torch.equal(unpack(packed, 4), torch.from_numpy(expected))
    for data, expected in file_tensors(default_model_file, Q.Q8_0, 1):
        packed = pack_int8(from_gguf_blocks(data, Q.Q8_0))
        assert torch.equal(unpack(packed, 8), torch.from_numpy(expected))


def test_q8_0_and_q4_0_blocks_decode_to_gguf_dequantize():
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((6, 96)).astype(np.float32)
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        data = gguf.quants.quantize(weights, kind)
        decoded = from_gguf_blocks(data, kind).dequantize()
        torch.testing.assert_close(decoded, torch.from_numpy(gguf.quants.dequantize(data, kind)),
                                   rtol=0, atol=1e-6)


def test_float_weights_quantized_at_load_stay_close():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    for quantized, step in ((quantize_int4(w, "t"), 1 / 15), (quantize_int8_rows(w, "t"), 1 / 254)):
        span = w.reshape(64, -1, 32) if quantized.bits == 4 else w[:, None, :]
        width = (span.amax(-1) - span.amin(-1)) if quantized.bits == 4 else 2 * span.abs().amax(-1)
        err = (quantized.dequantize() - w).reshape(span.shape).abs().amax(-1)
        assert (err <= width * step / 2 * 1.001 + 1e-6).all()


@pytest.mark.parametrize("fields, message", [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int4", dtype="float32"), "dtype=float32"),
    (dict(quantization="int8", tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(quantization="int8", batch_invariant=True), "batch_invariant=True"),
])
def test_quantizations_the_kernels_cannot_serve_are_refused_at_start(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**fields)


def test_auto_serves_stored_codes_in_bfloat16_only():
    assert WorkerConfig().served_quantization == "native"
    assert WorkerConfig(dtype="float32").served_quantization == "none"  # the parity dtype
    assert WorkerConfig(batch_invariant=True).served_quantization == "none"
    assert "--quantization" in WorkerConfig(quantization="int8").to_argv()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_float_checkpoint_quantized_at_load_serves_and_says_so(tiny_checkpoints, mode):
    reference = tiny_worker(tiny_checkpoints["llama"], dtype="bfloat16", quantization="none")
    assert "served in bfloat16" in reference.get_info().weights
    worker = tiny_worker(tiny_checkpoints["llama"], dtype="bfloat16", quantization=mode)
    kind = "int4 group 32" if mode == "int4" else "int8 per row"
    assert f"bfloat16 as {kind} x9" in worker.get_info().weights  # 2 layers x 4 + the LM head
    # A prefill past the weight-only kernel's rows, then decode steps within them.
    driver = StepDriver(worker.runner, worker.num_blocks, 16, chunk=64)
    driver.add("a", [(7 * i + 3) % 500 for i in range(40)], 8, greedy())
    assert len(driver.run()["a"]) == 8


NO_PACKING = not packing_available(torch.bfloat16, "cpu")


@pytest.mark.parametrize("small, large", [
    ("int4", "same"), ("int8", "same"), ("int4", "dense"), ("int4", "dyn8"),
    pytest.param("int4", "bf16", marks=pytest.mark.skipif(
        NO_PACKING, reason="oneDNN's packed bf16 linear needs AVX-512 (BW/VL/DQ) or "
        "AVX-NE-CONVERT, which this CPU lacks; the dense case is what serves here"))])
def test_each_kernel_computes_x_times_the_weight_it_stands_for(small, large):
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(96, 64) * 0.1, "t")
    dense = weight.dequantize()
    if small == "int8":
        weight = quantize_int8_rows(dense, "t")
        dense = weight.dequantize()
    layer = QuantLinear(weight, torch.bfloat16, small, large, small_rows=4)
    for rows in (1, 4, 37):
        x = torch.randn(rows, 64).bfloat16()
        expected = x.float() @ dense.t()
        # bfloat16 inputs and outputs; dyn8 also rounds x to 7-bit codes per call (fbgemm) and its
        # weight to int8 per row
        tolerance = 0.1 if large == "dyn8" and rows > 4 else 0.02
        torch.testing.assert_close(layer(x).float(), expected, rtol=0.02, atol=tolerance)


def test_a_quantized_linear_keeps_its_bias():
    """Qwen2-family models carry a q|k|v bias: the quantized layer adds it on every kernel."""
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(96, 64) * 0.1, "t")
    bias = torch.randn(96)
    for small_rows in (0, 64):  # the large kernel, then the small one
        layer = QuantLinear(weight, torch.float32, "int4", "dense", small_rows, bias)
        x = torch.randn(5, 64)
        torch.testing.assert_close(layer(x), x @ weight.dequantize().t() + bias,
                                   rtol=1e-4, atol=1e-4)
