"""A tiny Llama-shaped forward built from the kernels: interpreted Triton equals the torch path.

Two steps over the same paged cache: prompts (one chunked), then a mixed step of a decode row,
the chunked prompt's second chunk and a new prompt.
"""

import numpy as np
import torch
import torch.nn.functional as F
from batchwire import kernels
from batchwire.kernels import AttentionMetadata

HIDDEN, LAYERS, NUM_Q, NUM_KV, HEAD_DIM, FFN, VOCAB, BLOCK = 64, 2, 6, 2, 16, 96, 101, 16


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    weights = {"embed": torch.randn(VOCAB, HIDDEN, generator=gen), "final_norm": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        weights |= {
            f"{i}.qkv": w((NUM_Q + 2 * NUM_KV) * HEAD_DIM, HIDDEN),
            f"{i}.o": w(HIDDEN, NUM_Q * HEAD_DIM),
            f"{i}.gate_up": w(2 * FFN, HIDDEN),
            f"{i}.down": w(HIDDEN, FFN),
            f"{i}.norm1": 1 + w(HIDDEN),
            f"{i}.norm2": 1 + w(HIDDEN),
        }
    return weights


def forward(weights, caches, input_ids, positions, metadata, cos_sin, bitmask):
    num_tokens = input_ids.shape[0]
    h, residual = weights["embed"][input_ids], None  # [num_tokens, hidden]
    for i, (k_cache, v_cache) in enumerate(caches):
        if residual is None:
            x, residual = kernels.rms_norm(h, weights[f"{i}.norm1"], 1e-5), h
        else:
            x, residual = kernels.rms_norm(h, weights[f"{i}.norm1"], 1e-5, residual)
        qkv = x @ weights[f"{i}.qkv"].T  # [num_tokens, (nq + 2 nkv) * hd]
        q, k, v = qkv.split([NUM_Q * HEAD_DIM, NUM_KV * HEAD_DIM, NUM_KV * HEAD_DIM], -1)
        q, k = kernels.rotary_embedding(
            positions, q.view(num_tokens, NUM_Q, HEAD_DIM), k.view(num_tokens, NUM_KV, HEAD_DIM),
            cos_sin,
        )  # fmt: skip
        v = v.view(num_tokens, NUM_KV, HEAD_DIM)
        kernels.reshape_and_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, metadata, HEAD_DIM**-0.5)
        h = o.reshape(num_tokens, -1) @ weights[f"{i}.o"].T
        x, residual = kernels.rms_norm(h, weights[f"{i}.norm2"], 1e-5, residual)
        gate, up = (x @ weights[f"{i}.gate_up"].T).chunk(2, -1)
        h = (F.silu(gate) * up) @ weights[f"{i}.down"].T
    h, _ = kernels.rms_norm(h, weights["final_norm"], 1e-5, residual)
    last = metadata.query_start_loc[1:].long() - 1  # [num_reqs] last token of each request
    logits = h[last] @ weights["embed"].T  # [num_reqs, vocab]
    kernels.apply_token_bitmask(logits, bitmask)
    return logits


def step_metadata(blocks, computed, scheduled):
    """Metadata for requests owning `blocks`, with `computed` tokens cached, `scheduled` new."""
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    seq = (np.asarray(computed) + np.asarray(scheduled)).astype(np.int32)
    table = np.zeros((len(blocks), max(map(len, blocks))), dtype=np.int32)
    slots, positions = [], []
    for r, owned in enumerate(blocks):
        table[r, : len(owned)] = owned
        pos = np.arange(computed[r], seq[r])
        positions.append(pos)
        slots.append(np.asarray(owned)[pos // BLOCK] * BLOCK + pos % BLOCK)
    metadata = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(np.concatenate(slots).astype(np.int64)),
        max_query_len=int(max(scheduled)),
        max_seq_len=int(seq.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    return metadata, torch.from_numpy(np.concatenate(positions).astype(np.int64))


def run_two_steps(backend: str) -> list[torch.Tensor]:
    kernels.set_backend(backend)
    try:
        weights = make_weights(0)
        caches = [(torch.zeros(8, BLOCK, NUM_KV, HEAD_DIM), torch.zeros(8, BLOCK, NUM_KV, HEAD_DIM))
                  for _ in range(LAYERS)]  # fmt: skip
        angles = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
        cos_sin = torch.cat([angles.cos(), angles.sin()], -1)  # [64, head_dim]
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 40, 18)]
        allowed = torch.full((3, 4), -1, dtype=torch.int32)
        allowed[1, 1] = 0x0F0F0F0F  # one request under a grammar

        # Step 1: request 0's whole prompt, request 1's first 24 tokens.
        md, pos = step_metadata([[3], [0, 5, 6]], [0, 0], [7, 24])
        ids = torch.cat([prompts[0], prompts[1][:24]])
        out1 = forward(weights, caches, ids, pos, md, cos_sin, allowed[:2])
        # Step 2: request 0 decodes, request 1's last 16 tokens, request 2's whole prompt.
        md, pos = step_metadata([[3], [0, 5, 6], [2, 7]], [7, 24, 0], [1, 16, 18])
        ids = torch.cat([torch.tensor([5]), prompts[1][24:], prompts[2]])
        out2 = forward(weights, caches, ids, pos, md, cos_sin, allowed)
        return [out1, out2, *(c for pair in caches for c in pair)]
    finally:
        kernels.set_backend("auto")


def test_tiny_model_forward_triton_equals_torch():
    for got, want in zip(run_two_steps("triton"), run_two_steps("torch"), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
