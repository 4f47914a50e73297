"""Every Triton kernel compiles for an H100/H200 (sm_90) without a GPU present.

The interpreter runs kernels as numpy and misses what only the compiler checks (loop-carried
types, constexpr specialisation, shared memory), so the real compiler is run down to a cubin.
"""

import importlib

import pytest
from batchwire.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

POINTER_TYPES = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "qsl_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "positions_ptr": "*i64",
    "row_indices_ptr": "*i64",
    "bitmask_ptr": "*i32",
    "cos_sin_ptr": "*fp32",
    "logits_ptr": "*fp32",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
}
ATTENTION = dict(GROUP=3, HEAD_DIM=80, HEAD_DIM_P2=128, BLOCK_SIZE=16, BLOCK_N=64)
DOTS = dict(DOT_PRECISION="tf32", DOT_IN_FP32=False)
KERNELS = {
    # num_reqs=1 as a constant: what Triton's specialisation of an int argument equal to 1 does.
    "main-decode": ("paged_attention", "_paged_attention_kernel",
                    dict(num_reqs=1, BLOCK_Q=5, BLOCK_M=16, **ATTENTION, **DOTS)),
    "main-prefill": ("paged_attention", "_paged_attention_kernel",
                     dict(BLOCK_Q=21, BLOCK_M=64, **ATTENTION, **DOTS)),
    "split": ("paged_attention_split_kv", "_paged_decode_split_kernel",
              dict(NUM_SPLITS=8, BLOCK_M=16, **ATTENTION, **DOTS)),
    "reduce": ("paged_attention_split_kv", "_paged_decode_reduce_kernel",
               dict(NUM_SPLITS=8, SPLITS_P2=8, HEAD_DIM=80, HEAD_DIM_P2=128)),
    "cache": ("reshape_and_cache", "_reshape_and_cache_kernel",
              dict(HEAD_DIM=80, BLOCK_SIZE=16, NUM_HEADS_P2=4, HEAD_DIM_P2=128)),
    "rms_norm": ("rms_norm", "_rms_norm_kernel", dict(HAS_RESIDUAL=True, BLOCK=1024)),
    "rotary": ("rotary_embedding", "_rotary_kernel",
               dict(HALF=40, HALF_P2=64, Q_HEADS_P2=16, KV_HEADS_P2=4)),
    "bitmask": ("token_bitmask", "_token_bitmask_kernel", dict(HAS_ROW_INDICES=True, BLOCK=1024)),
}  # fmt: skip


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_for_sm90(name, monkeypatch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    module, kernel_name, constants = KERNELS[name]
    kernel = getattr(importlib.import_module(f"batchwire.kernels.{module}"), kernel_name)
    signature = {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = POINTER_TYPES.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg in ("eps", "scale_log2") else "i32"
    compiled = triton.compile(
        ASTSource(kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 227 * 1024  # an sm_90 block's shared memory
