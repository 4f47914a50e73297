"""Triton kernels on a CUDA device: correctness against the references, then paged attention speed.

    .venv/bin/python benchmarks/gpu/kernels_gpu.py            # on a CUDA machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu/kernels_gpu.py --smoke   # tiny, on CPU

Reports paged_attention decode bandwidth (bytes of K/V read per second) and prefill TFLOP/s,
each next to torch's scaled_dot_product_attention on the same data laid out contiguously
(SDPA does not read a paged cache, so its gather is not timed: that favours SDPA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from batchwire.benchmarks.shared.help_format import DefaultsSaid
from batchwire.kernels import AttentionMetadata  # noqa: E402
from batchwire.kernels.paged_attention import paged_attention_reference, paged_attention_triton  # noqa: E402
from batchwire.kernels.reshape_and_cache import reshape_and_cache_torch, reshape_and_cache_triton  # noqa: E402
from batchwire.kernels.rms_norm import rms_norm_torch, rms_norm_triton  # noqa: E402
from batchwire.kernels.rotary_embedding import rotary_embedding_torch, rotary_embedding_triton  # noqa: E402
from batchwire.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton  # noqa: E402

ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_step(query_lens, seq_lens, num_q, num_kv, head_dim, block_size, dtype, device, seed=0):
    """A paged batch on `device`: blocks scattered over the cache, every position filled."""
    rng = np.random.default_rng(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req)
    order = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), max(per_req)), dtype=np.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n], used = order[used : used + n], used + n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = np.asarray(seq_lens, dtype=np.int32)
    slots = []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = np.arange(s_len - q_len, s_len)
        slots.append(table[r, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        max_query_len=int(max(query_lens)),
        max_seq_len=int(seq.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    shape = (num_blocks, block_size, num_kv, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(int(qsl[-1]), num_q, head_dim, dtype=dtype, device=device)
    return query, k_cache, v_cache, md


def contiguous_kv(k_cache, v_cache, md, length):
    """[num_reqs, nkv, length, hd] K and V gathered from the paged cache, for SDPA."""
    block_size = k_cache.shape[1]
    table = md.block_table[:, : length // block_size].long()  # [num_reqs, blocks]

    def gather(cache):
        g = cache[table]  # [num_reqs, blocks, block_size, nkv, hd]
        return g.flatten(1, 2).transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def bench_ms(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check(name, got, want, atol, rtol=0.0):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    print(f"  ok  {name}")


def check_kernels(device, dtype, attention_shapes) -> None:
    print(f"correctness ({dtype}):")
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for num_q, num_kv, head_dim, block_size in attention_shapes:
        q, kc, vc, md = make_step(
            [1, 37, 1, 200, 5], [1, 100, 1000, 300, 513], num_q, num_kv, head_dim, block_size,
            dtype, device,
        )  # fmt: skip
        want = paged_attention_reference(q, kc, vc, md, head_dim**-0.5)
        got = paged_attention_triton(q, kc, vc, md, head_dim**-0.5)
        tag = f"{num_q}q/{num_kv}kv d{head_dim} b{block_size}"
        check(f"paged_attention mixed {tag}", [got], [want], ATOL[dtype])
        q, kc, vc, md = make_step(
            [1] * 3, [3000, 17, 700], num_q, num_kv, head_dim, block_size, dtype, device
        )
        want = paged_attention_reference(q, kc, vc, md, 0.1)
        got = paged_attention_triton(q, kc, vc, md, 0.1, num_kv_splits=8)
        check(f"paged_attention split-KV decode {tag}", [got], [want], ATOL[dtype])

    key, value = randn(300, 8, 128), randn(300, 8, 128)
    slots = torch.randperm(64 * 16, generator=gen)[:300].to(device)
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, dtype=dtype, device=device) for _ in range(4)]
    reshape_and_cache_triton(key, value, caches[0], caches[1], slots)
    reshape_and_cache_torch(key, value, caches[2], caches[3], slots)
    check("reshape_and_cache", caches[:2], caches[2:], 0.0)

    x, res, w = randn(257, 4096), randn(257, 4096), randn(4096)
    check("rms_norm", [rms_norm_triton(x, w, 1e-6)], [rms_norm_torch(x, w, 1e-6)], ATOL[dtype])
    got_pair, want_pair = rms_norm_triton(x, w, 1e-6, res), rms_norm_torch(x, w, 1e-6, res)
    check("rms_norm + residual", got_pair, want_pair, ATOL[dtype], 1e-2)

    pos = torch.randint(0, 4096, (257,), generator=gen).to(device)
    cos_sin = torch.randn(4096, 128, generator=gen).to(device)
    q, k = randn(257, 32, 128), randn(257, 8, 128)
    got_qk = rotary_embedding_triton(pos, q.clone(), k.clone(), cos_sin)
    want_qk = rotary_embedding_torch(pos, q.clone(), k.clone(), cos_sin)
    check("rotary_embedding", got_qk, want_qk, ATOL[dtype], 1e-2)

    logits = torch.randn(9, 50257, generator=gen).to(device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 1571), generator=gen, dtype=torch.int32)
    rows = torch.tensor([8, 0, 3, 5], device=device)
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask_triton(got, bitmask.to(device), rows)
    apply_token_bitmask_torch(want, bitmask.to(device), rows)
    check("apply_token_bitmask", [got], [want], 0.0)


def bench_decode(device, dtype, num_reqs, context, num_q, num_kv, head_dim, block_size) -> None:
    q, kc, vc, md = make_step(
        [1] * num_reqs, [context] * num_reqs, num_q, num_kv, head_dim, block_size, dtype, device
    )
    kv_bytes = 2 * num_reqs * context * num_kv * head_dim * kc.element_size()
    ms = bench_ms(lambda: paged_attention_triton(q, kc, vc, md, 0.1), device)
    k, v = contiguous_kv(kc, vc, md, context)
    q4 = q.view(num_reqs, num_q, 1, head_dim)
    sdpa_ms = bench_ms(
        lambda: F.scaled_dot_product_attention(q4, k, v, scale=0.1, enable_gqa=True), device
    )
    print(
        f"decode  {num_reqs:>3} x {context:>6} ctx: paged_attention {ms * 1e3:8.1f} us "
        f"{kv_bytes / ms / 1e6:7.1f} GB/s | SDPA (contiguous) {sdpa_ms * 1e3:8.1f} us "
        f"{kv_bytes / sdpa_ms / 1e6:7.1f} GB/s"
    )


def bench_prefill(device, dtype, num_reqs, length, num_q, num_kv, head_dim, block_size) -> None:
    q, kc, vc, md = make_step(
        [length] * num_reqs, [length] * num_reqs, num_q, num_kv, head_dim, block_size, dtype,
        device,
    )  # fmt: skip
    # Causal: half of the QK^T and PV products, 2 FLOPs per multiply-add.
    flops = num_reqs * num_q * head_dim * length * length * 2
    ms = bench_ms(lambda: paged_attention_triton(q, kc, vc, md, 0.1), device)
    k, v = contiguous_kv(kc, vc, md, length)
    q4 = q.view(num_reqs, length, num_q, head_dim).transpose(1, 2)
    sdpa_ms = bench_ms(
        lambda: F.scaled_dot_product_attention(
            q4, k, v, is_causal=True, scale=0.1, enable_gqa=True
        ),
        device,
    )
    print(
        f"prefill {num_reqs:>3} x {length:>6} tok: paged_attention {ms:8.2f} ms "
        f"{flops / ms / 1e9:7.1f} TFLOP/s | SDPA (contiguous) {sdpa_ms:8.2f} ms "
        f"{flops / sdpa_ms / 1e9:7.1f} TFLOP/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsSaid)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("no CUDA device: run on a GPU machine, or with --smoke under TRITON_INTERPRET=1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.smoke:
        check_kernels(device, torch.float32, [(6, 2, 80, 16)])
        bench_decode(device, torch.float16, 2, 64, 4, 2, 64, 16)
        bench_prefill(device, torch.float16, 1, 32, 4, 2, 64, 16)
        return
    print(torch.cuda.get_device_name(device))
    for dtype in (torch.bfloat16, torch.float16):
        check_kernels(device, dtype, [(32, 8, 128, 16), (9, 3, 64, 32), (16, 2, 80, 16)])
    # Llama-3-8B attention shapes: 32 query / 8 KV heads, head_dim 128, bfloat16, block 16.
    shape = (32, 8, 128, 16)
    for num_reqs, context in [(64, 4096), (256, 1024), (8, 32768), (1, 131072)]:
        bench_decode(device, torch.bfloat16, num_reqs, context, *shape)
    for num_reqs, length in [(4, 2048), (1, 8192)]:
        bench_prefill(device, torch.bfloat16, num_reqs, length, *shape)


if __name__ == "__main__":
    main()
