"""The native step's C functions alone, without a model, on every form each CPU builds: the
products (each input as two int8 digits times the stored codes), the LM head's exact top logits
past one call's rows, the int4 packing, and the library's build cache. The whole step against
the torch path is test_native_decode.py."""

from __future__ import annotations

import logging

import pytest
import torch

from worker_svc.native import library
from worker_svc.native.decoder import EXACT_TOP, pack_int4, pack_int8, unpack
from worker_svc.quant.blocks import INT4_OFFSET, QuantizedWeight, quantize_int4


def round_to_digits(x: torch.Tensor) -> torch.Tensor:
    """x as decode.c's quantize_rows leaves it: per group of 32, e = max|x| / 127,
    hi = rint(x / e), lo = rint((x - hi e) / (e / 127)), x ~ (127 hi + lo) e / 127."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    e = top / 127
    hi = torch.round(groups * inverse)
    lo = torch.round((groups - hi * e) * (127 * inverse))
    return ((127 * hi + lo) * (e / 127)).reshape(x.shape)



def stored_like_the_file(n: int, k: int, bits: int) -> QuantizedWeight:
    """A random weight of the file's kinds: Q4_1 (scale, min) or Q8_0, float16 scales."""
    torch.manual_seed(n + bits)
    if bits == 4:
        weight = quantize_int4(torch.randn(n, k), "test")
        scale = weight.scale.half().float()
        low = (weight.zero - INT4_OFFSET * weight.scale).half().float()  # Q4_1's min
        return QuantizedWeight(4, weight.codes, scale, low + INT4_OFFSET * scale, 32, "Q4_1-like")
    scale = (torch.rand(n, k // 32) / 100).half().float()
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return QuantizedWeight(8, codes, scale, torch.zeros_like(scale), 32, "Q8_0-like")


MAX_TOP = 16  # head.h's

# Each form of the products, built on any x86 machine: the first this CPU runs (AVX-512 VNNI
# where it has them), AVX2, and the portable loop.
BUILDS = {"native": None, "haswell": b"avx2", "x86-64": b"portable"}


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_each_product_is_the_rounded_input_times_the_stored_weight(bits, march):
    """decode.c's products read the packed weights as `unpack` lays them out, and compute
    round_to_digits(x) @ w.T for 1 to 8 rows; the packed form holds the stored weight."""
    lib = library.load(march)
    assert lib is not None
    assert BUILDS[march] in (None, lib.bw_products())
    weight = stored_like_the_file(96, 576, bits)
    packed = pack_int4(weight) if bits == 4 else pack_int8(weight)
    dense = unpack(packed, bits)
    torch.testing.assert_close(dense, weight.dequantize(), rtol=0, atol=1e-6)
    qmat = library.QMat(bits, 96, 576, *(t.data_ptr() for t in packed),
                        *([None] if bits == 8 else []))
    scratch = torch.empty(8 * 576)
    for rows in range(1, 9):
        x = torch.randn(rows, 576) * torch.logspace(-2, 1, 576)  # groups of unlike ranges
        y = torch.empty(rows, 96)
        assert lib.bw_matvec(qmat, rows, x.data_ptr(), y.data_ptr(), scratch.data_ptr(), 2) == 0
        expected = round_to_digits(x).double() @ dense.double().T
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4,
                                   msg=f"{rows} rows")


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_the_head_of_more_rows_widens_bfloat16_logits_and_makes_each_rows_top_exact(bits, march):
    """bw_head_logits, past one call's rows: each logit is torch's bfloat16 one widened, except
    each row's EXACT_TOP largest, which are the stored head's own values times the hidden
    state (a vocabulary not a multiple of 16, for the tail)."""
    lib = library.load(march)
    assert lib is not None
    vocab, hidden_size, rows = 1000, 576, 12
    weight = stored_like_the_file(vocab, hidden_size, bits)
    packed = pack_int4(weight) if bits == 4 else pack_int8(weight)
    model = library.Model(lm_head=library.QMat(bits, vocab, hidden_size,
                                               *(t.data_ptr() for t in packed),
                                               *([None] if bits == 8 else [])))
    torch.manual_seed(bits)
    hidden = torch.randn(rows, hidden_size)
    exact = hidden.double() @ weight.dequantize().double().T
    rough = exact.to(torch.bfloat16)  # as torch's bfloat16 GEMM hands its output back
    out = torch.empty(rows, vocab)
    for top in (0, MAX_TOP + 1):
        assert lib.bw_head_logits(model, rows, hidden.data_ptr(), rough.data_ptr(),
                                  out.data_ptr(), top, 2) == -1
    assert lib.bw_head_logits(model, rows, hidden.data_ptr(), rough.data_ptr(), out.data_ptr(),
                              EXACT_TOP, 2) == 0
    widened = rough.float()
    bar = widened.topk(EXACT_TOP).values[:, -1:]  # ties at the bar may go either way
    above, below = widened > bar, widened < bar
    torch.testing.assert_close(out[above].double(), exact[above], rtol=1e-5, atol=1e-4)
    assert torch.equal(out[below], widened[below])
    assert ((out != widened).sum(-1) <= EXACT_TOP).all()
    assert torch.equal(out.argmax(-1), exact.argmax(-1))


def test_int4_packing_holds_the_codes_and_the_weight():
    torch.manual_seed(0)
    weight = quantize_int4(torch.randn(8, 64), "float32 at load")
    packed, scale, bias = pack_int4(weight)
    # tile t, group g, row j of the tile: 16 bytes, low nibbles elements 0-15, high ones 16-31
    codes = torch.cat([packed & 15, packed >> 4], dim=-1)  # [2, 2, 4, 32]
    assert torch.equal(codes.transpose(1, 2).reshape(8, 64), weight.codes)
    # float16 scales and biases: within their rounding (2^-11 of each) of quantize_int4's
    low = (weight.zero - INT4_OFFSET * weight.scale).repeat_interleave(32, 1)
    bound = 2.0 ** -11 * (15 * weight.scale.repeat_interleave(32, 1) + low.abs()) + 1e-7
    assert ((unpack((packed, scale, bias), 4) - weight.dequantize()).abs() <= bound).all()


def test_the_library_is_built_once_per_source_and_not_without_a_compiler(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHWIRE_CACHE_DIR", str(tmp_path / "cache"))
    assert library.load() is not None
    built = list((tmp_path / "cache" / "native").glob("decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert library.load() is not None
    assert built[0].stat().st_mtime_ns == mtime  # found, not built again
    monkeypatch.setenv("BATCHWIRE_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with caplog.at_level(logging.WARNING, logger="worker_svc.native.library"):
        assert library.load() is None
    assert "native CPU decode off: false failed to build decode.c" in caplog.text
