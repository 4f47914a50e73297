"""The native CPU step: a loaded model's decode rows in one call into decode.c, and every other
step with torch's products and the rest of each layer in C.

`NativeDecoder.build` takes the model while its parameters are still float32 (the norms as the
file stores them) and the quantized weights as the loader read them (the Worker asks for it
through load_model's before_cast), and lays them out for the C step: rows in tiles of four,
4-bit codes two per byte with float16 scales and biases per group of 32, 8-bit codes moved to
unsigned bytes with float16 scales (GGUF's Q4_0, Q4_1 and Q8_0 without loss: GGUF stores its
scales in float16; a checkpoint quantized at load loses their rounding to float16). The
model's forward hands it every step without adapters (`_native_serves` in models/llama.py):
up to MAX_ROWS decode rows go to `decode`, one call; the rest (prompt chunks, more rows,
drafts) to `between`. Steps with adapters stay on the torch path, attending through
`NativeAttention` when they are decode rows only.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import numpy as np
import torch
from batchwire.kernels import AttentionMetadata

from worker_svc.models.llama import AttendFn, LlamaForCausalLM
from worker_svc.native import library
from worker_svc.quant.blocks import GROUP, INT4_OFFSET, QuantizedWeight

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # decode.c's MAX_ROWS: the most decode rows one call takes
# Logits computed again exactly per row, past one call's rows (head.h): the top token and its
# nearest rivals; on the quality text 4 already gave what 16 did.
EXACT_TOP = 8
MAX_THREADS = 16  # the OpenMP team's largest size: the scratch holds attention scores per thread
MAX_HEAD_DIM = 256  # decode.c's MAX_HEAD_DIM
# The longest context a prompt chunk's tokens attend over in between(): each attends on its own
# there, where the torch kernel multiplies a request's queries by its keys as matrices, and
# catches up at ~512 positions (benchmarks/offline/prefill_paths.py, runs on the noisy Xeon of
# docs/performance.md: a 256-token prompt's step 1.20-1.49x as fast in between(), 512 tokens
# 0.99-1.05x, 1024 0.83x, 2048 0.76-0.96x). Longer ones: the torch path.
PROMPT_CONTEXT_LIMIT = 512
# The most floats between()'s attention takes at once (256 MiB): a long prompt's tokens attend
# in slices of fewer tokens than that.
ATTENTION_SCRATCH_FLOATS = 64 << 20


ROW_TILE = 4  # decode.c's ROW_TILE: weight rows interleaved per tile


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, G, ...] per row and group -> [N / 4, G, 4, ...]: four rows' groups side by side."""
    n, groups = t.shape[:2]
    return t.reshape(n // ROW_TILE, ROW_TILE, groups, *t.shape[2:]).transpose(1, 2)


def _half(t: torch.Tensor) -> torch.Tensor:
    """Scales and biases as decode.c reads them: float16 [N / 4, G, 4]."""
    return _tiles(t.to(torch.float16)).contiguous()


def pack_int4(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N / 4, G, 4, 16] uint8, scale [N / 4, G, 4], bias [N / 4, G, 4] float16) with
    w = q * scale + bias: for tile t (rows 4t..4t+3) and group g, row j's 16 bytes, byte i
    holding element i in its low nibble and element i + 16 in its high one (decode.c)."""
    n, k = weight.shape
    codes = weight.codes.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    packed = _tiles(codes[:, :, 0] | (codes[:, :, 1] << 4)).contiguous()
    bias = weight.zero - INT4_OFFSET * weight.scale
    return packed, _half(weight.scale), _half(bias)


def pack_int8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes + 128 [N / 4, G, 2, 4, 16] uint8, scale [N / 4, G, 4] float16):
    w = (q - 128) * scale, the signed codes moved into unsigned bytes (vpdpbusd multiplies
    unsigned by signed bytes; the step derives the bias, -128 * scale, rather than reading one).
    For tile t and group g: elements 0-15 of its four rows, then elements 16-31."""
    n, k = weight.shape
    codes = (weight.codes.to(torch.int16) + 128).to(torch.uint8)
    halves = _tiles(codes.reshape(n, k // GROUP, 2, GROUP // 2)).transpose(2, 3)
    return halves.contiguous(), _half(weight.scale)


def unpack(packed: tuple[torch.Tensor, ...], bits: int) -> torch.Tensor:
    """The float32 weight [N, K] that pack_int4's or pack_int8's output stands for."""
    if bits == 4:
        codes, scale, bias = packed
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # [N / 4, G, 4, 32]
        values = q * scale.float()[..., None] + bias.float()[..., None]
    else:
        codes, scale = packed
        q = codes.transpose(2, 3).reshape(*codes.shape[:2], ROW_TILE, GROUP).float() - 128
        values = q * scale.float()[..., None]
    tiles, groups = values.shape[:2]
    return values.transpose(1, 2).reshape(tiles * ROW_TILE, groups * GROUP)


def why_not(stored: dict[str, QuantizedWeight], names: list[str]) -> str | None:
    """Why the native step cannot serve these weights; None when it can."""
    for name in names:
        weight = stored.get(name)
        if weight is None:
            return f"{name} is not stored quantized"
        if weight.group != GROUP or weight.bits not in (4, 8):
            return f"{name} is {weight.source}, not 4- or 8-bit groups of {GROUP}"
        if weight.shape[0] % ROW_TILE:
            return f"{name} has {weight.shape[0]} rows, not a multiple of {ROW_TILE}"
    return None


class NativeDecoder:
    """The model's DecodeStep (models/llama.py) on CPU."""

    max_rows = MAX_ROWS

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM,
                 stored: dict[str, QuantizedWeight], max_model_len: int) -> None:
        self.lib = lib
        cfg = model.config
        self._keep: list[torch.Tensor] = []  # every tensor the structs point into
        layers = model.decoder_layers()
        self.layers = (library.Layer * len(layers))()
        for i, layer in enumerate(layers):
            prefix = f"layers.{i}"
            bias = layer.self_attn.qkv_proj.bias
            self.layers[i] = library.Layer(
                self._floats(layer.input_layernorm.weight),
                self._floats(layer.post_attention_layernorm.weight),
                self._floats(bias) if bias is not None else None,
                self._qmat(stored[f"{prefix}.self_attn.qkv_proj.weight"]),
                self._qmat(stored[f"{prefix}.self_attn.o_proj.weight"]),
                self._qmat(stored[f"{prefix}.mlp.gate_up_proj.weight"]),
                self._qmat(stored[f"{prefix}.mlp.down_proj.weight"]),
                None, None)
        self.attention = model.attention_layers()
        self.model = library.Model(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, num_layers=len(layers),
            block_size=0, num_blocks=0, cache_bf16=0, max_rows=MAX_ROWS,
            max_seq_len=max_model_len, eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5,
            cos_sin=self._floats(model.cos_sin), layers=self.layers,
            final_norm=self._floats(model.norm.weight) if model.norm is not None else None,
            lm_head=self._qmat(stored["lm_head.weight"]))
        self._cache_ptr = 0
        self._scratch = torch.empty(lib.bw_scratch_floats(self.model, MAX_ROWS, MAX_THREADS))
        self._attention_scratch = torch.empty(0)  # grown to the largest step bw_attend served
        # For between(): each layer's projections (their torch modules, read at each step: the
        # loader may replace them after this) and the norms' float32 weights.
        self._decoder_layers = layers
        self._norms = [(self.layers[i].input_norm, self.layers[i].post_norm)
                       for i in range(len(layers))]
        self._final_norm = self.model.final_norm

    @classmethod
    def build(cls, model: LlamaForCausalLM, stored: dict[str, QuantizedWeight],
              max_model_len: int, where_faster: bool = True) -> NativeDecoder | None:
        """The native step for a whole (unsharded) model whose linear weights are all stored
        4- or 8-bit; None, with the reason logged, where it cannot serve or (where_faster) where
        it would be slower than the torch path."""
        cfg = model.config
        names = [f"layers.{i}.{part}.weight" for i in range(cfg.num_layers) for part in (
            "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        reason = why_not(stored, [*names, "lm_head.weight"])
        if reason is None and cfg.qk_norm:
            reason = "the model normalises q and k per head (not in the native step)"
        if reason is None and (cfg.head_dim % 16 or cfg.head_dim > MAX_HEAD_DIM):
            reason = f"head_dim {cfg.head_dim} is not a multiple of 16 up to {MAX_HEAD_DIM}"
        if reason is None and model.cos_sin.shape[1] != cfg.head_dim:
            reason = "rotary covers part of each head only"
        if reason is not None:
            logger.info("native CPU decode off: %s", reason)
            return None
        lib = library.load()
        if lib is not None and where_faster and lib.bw_products() == b"portable":
            logger.info("native CPU decode off: this CPU has neither AVX-512 VNNI nor AVX2, "
                        "where the step's portable loop is slower than the torch path")
            return None
        return None if lib is None else cls(lib, model, stored, max_model_len)

    def describe(self) -> str:
        products = self.lib.bw_products().decode()
        return (f"decode steps of up to {MAX_ROWS} rows: one native call (the stored weights "
                f"as they are, times inputs as two int8 digits per group of 32, on {products}); "
                "other steps: torch's products, the rest of each layer in C, each row's "
                f"top {EXACT_TOP} logits from the stored head")

    def _floats(self, t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _qmat(self, weight: QuantizedWeight) -> library.QMat:
        n, k = weight.shape
        if weight.bits == 4:
            packed, scale, bias = pack_int4(weight)
            self._keep += [packed, scale, bias]
            return library.QMat(4, n, k, packed.data_ptr(), scale.data_ptr(), bias.data_ptr())
        codes, scale = pack_int8(weight)
        self._keep += [codes, scale]
        return library.QMat(8, n, k, codes.data_ptr(), scale.data_ptr(), None)

    def _attach_cache(self) -> None:
        """Points each layer at its K/V cache's head-major storage (again, if reallocated)."""
        first = self.attention[0].k_cache
        assert first is not None, "KV cache not allocated"
        if first.data_ptr() == self._cache_ptr:
            return
        assert first.dtype in (torch.bfloat16, torch.float32), f"a {first.dtype} KV cache"
        num_blocks, block_size = first.shape[:2]
        for i, attn in enumerate(self.attention):
            k_cache, v_cache = attn.k_cache, attn.v_cache
            assert k_cache is not None and v_cache is not None, "KV cache not allocated"
            for cache in (k_cache, v_cache):
                assert cache.permute(2, 0, 1, 3).is_contiguous(), (
                    "the native step reads the CPU cache's head-major storage")
            self.layers[i].k_cache = k_cache.data_ptr()
            self.layers[i].v_cache = v_cache.data_ptr()
        self.model.block_size, self.model.num_blocks = block_size, num_blocks
        self.model.cache_bf16 = int(first.dtype == torch.bfloat16)
        self._cache_ptr = first.data_ptr()

    def decode(self, embedded: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        """embedded [R, hidden] -> the final-normed hidden states [R, hidden], the K/V of each
        row's token written to the cache, in float32. R <= MAX_ROWS decode rows; positions [R]
        int64, block_table [R, width] int32, seq_lens [R] int32 (the context after the step)."""
        self._attach_cache()
        x = embedded.float().contiguous()
        if x.data_ptr() == embedded.data_ptr():
            x = x.clone()  # the step writes its result into x
        # The C step reads them as int64, int32 and int32 arrays.
        positions = positions.to(torch.int64).contiguous()
        block_table = block_table.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        rows = x.shape[0]
        threads = min(torch.get_num_threads(), MAX_THREADS)
        code = self.lib.bw_decode(
            self.model, rows, x.data_ptr(), positions.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], seq_lens.data_ptr(), self._scratch.data_ptr(), threads)
        if code != 0:
            raise ValueError(f"native decode refused {rows} rows at positions "
                             f"{positions.tolist()} with context lengths {seq_lens.tolist()}")
        return x

    def serves(self, metadata: AttentionMetadata) -> bool:
        """Whether between() takes this step: no prompt chunk in it attends over more than
        PROMPT_CONTEXT_LIMIT positions."""
        prompt = np.diff(metadata.query_start_loc_cpu) > 1
        return not bool((metadata.seq_lens_cpu[prompt] > PROMPT_CONTEXT_LIMIT).any())

    def between(self, embedded: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Any step of tokens that decode() does not take (prompt chunks, more than MAX_ROWS
        decode rows, drafts): embedded [T, hidden] -> the final-normed hidden states [T, hidden]
        in embedded's dtype. Each layer's four products run on the torch path (its QuantLinear
        modules: oneDNN's bfloat16 GEMM at these sizes, the fastest kernel here); every stretch
        between them is one C call (between.h): the residual add and norm, rotary with the K/V
        write and attention, SiLU times up. The residual stream stays float32."""
        self._attach_cache()
        dtype = embedded.dtype
        assert dtype in (torch.bfloat16, torch.float32), f"{dtype} activations"
        bf16 = int(dtype == torch.bfloat16)
        tokens = embedded.shape[0]
        qsl = metadata.query_start_loc_cpu
        assert int(qsl[-1]) == tokens, "one embedded row per scheduled token"
        # Each token a row of its own: its request's block table, its context up to itself.
        request = torch.from_numpy(np.repeat(np.arange(len(qsl) - 1), np.diff(qsl)))
        tables = metadata.block_table[request].to(torch.int32).contiguous()
        positions = positions.to(torch.int64).contiguous()
        seq_lens = (positions + 1).to(torch.int32)
        threads = min(torch.get_num_threads(), MAX_THREADS)
        slices = self._attention_slices(tokens, int(seq_lens.max()), threads)
        lib, model = self.lib, self.model
        resid = embedded.float().contiguous()
        if resid.data_ptr() == embedded.data_ptr():
            resid = resid.clone()
        h = torch.empty(tokens, model.hidden, dtype=dtype)
        attended = torch.empty(tokens, model.num_heads * model.head_dim, dtype=dtype)
        act = torch.empty(tokens, model.intermediate, dtype=dtype)
        added: torch.Tensor | None = None  # the last product's output, not yet in the stream
        for i, layer in enumerate(self._decoder_layers):
            input_norm, post_norm = self._norms[i]
            lib.bw_add_norm(model, input_norm, tokens, resid.data_ptr(),
                            None if added is None else added.data_ptr(), h.data_ptr(), bf16,
                            threads)
            qkv = layer.self_attn.qkv_proj(h).contiguous()
            # In slices of tokens, in order: a token attends only its request's earlier tokens,
            # whose K/V an earlier slice (or this one, first) wrote.
            for start, end in slices:
                code = lib.bw_attend_qkv(
                    model, i, end - start, qkv[start].data_ptr(), positions[start].data_ptr(),
                    tables[start].data_ptr(), tables.shape[1], seq_lens[start].data_ptr(),
                    attended[start].data_ptr(), bf16, self._attention_scratch.data_ptr(),
                    threads)
                if code != 0:
                    raise ValueError(f"native attention refused tokens at positions "
                                     f"{positions[start:end].tolist()}")
            o = layer.self_attn.o_proj(attended).contiguous()
            lib.bw_add_norm(model, post_norm, tokens, resid.data_ptr(), o.data_ptr(),
                            h.data_ptr(), bf16, threads)
            gate_up = layer.mlp.gate_up_proj(h).contiguous()
            lib.bw_silu_mul(model, tokens, gate_up.data_ptr(), act.data_ptr(), bf16, threads)
            added = layer.mlp.down_proj(act).contiguous()
        lib.bw_add_norm(model, self._final_norm, tokens, resid.data_ptr(),
                        None if added is None else added.data_ptr(), h.data_ptr(), bf16, threads)
        return h

    def _attention_slices(self, tokens: int, longest: int, threads: int
                          ) -> list[tuple[int, int]]:
        """[start, end) slices of the step's tokens whose attention scratch (each token's part
        per chunk of its context) fits ATTENTION_SCRATCH_FLOATS; the scratch grown to fit."""
        floats = self.lib.bw_attend_qkv_floats
        base = floats(self.model, 0, longest, threads)
        per_token = floats(self.model, 1, longest, threads) - base
        size = max(1, min(tokens, (ATTENTION_SCRATCH_FLOATS - base) // per_token))
        need = floats(self.model, size, longest, threads)
        if self._attention_scratch.numel() < need:
            self._attention_scratch = torch.empty(need)
        return [(start, min(start + size, tokens)) for start in range(0, tokens, size)]

    def attend(self, layer: int, query: torch.Tensor, metadata: AttentionMetadata
               ) -> torch.Tensor:
        """Layer `layer`'s attention for a step of decode rows only, any number of them:
        query [R, heads, head_dim] (rotated; the torch path wrote this step's K/V) -> the output
        in query's dtype, read from the cache in place."""
        self._attach_cache()
        rows = metadata.num_reqs
        q = query[:rows].reshape(rows, -1).float().contiguous()
        out = torch.empty_like(q)
        block_table = metadata.block_table[:rows].to(torch.int32).contiguous()
        seq_lens = metadata.seq_lens[:rows].to(torch.int32).contiguous()
        threads = min(torch.get_num_threads(), MAX_THREADS)
        need = self.lib.bw_attention_floats(self.model, rows, int(seq_lens.max()), threads)
        if self._attention_scratch.numel() < need:
            self._attention_scratch = torch.empty(need)
        code = self.lib.bw_attend(
            self.model, layer, rows, q.data_ptr(), block_table.data_ptr(), block_table.shape[1],
            seq_lens.data_ptr(), out.data_ptr(), self._attention_scratch.data_ptr(), threads)
        if code != 0:
            raise ValueError(f"native attention refused {rows} rows with context lengths "
                             f"{seq_lens.tolist()}")
        result = out.view(rows, *query.shape[1:]).to(query.dtype)
        if rows < query.shape[0]:  # padding rows: defined, never read
            result = torch.cat([result, query.new_zeros(query.shape[0] - rows, *query.shape[1:])])
        return result

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        """hidden [R, hidden] -> float32 logits [R, vocab]. Up to MAX_ROWS rows: the stored LM
        head in C, as decode() computes its products. More: `head` (the model's QuantLinear,
        torch's GEMM, which reads the head once for all rows), whose bfloat16 logits get each
        row's EXACT_TOP largest computed again from the stored head (head.h says why)."""
        rows = hidden.shape[0]
        threads = min(torch.get_num_threads(), MAX_THREADS)
        if rows <= MAX_ROWS:
            hidden32, out = hidden.float().contiguous(), torch.empty(rows, self.model.lm_head.n)
            if rows:
                self.lib.bw_lm_head(self.model, rows, hidden32.data_ptr(), out.data_ptr(),
                                    self._scratch.data_ptr(), threads)
            return out
        rough = head(hidden)
        if rough.dtype != torch.bfloat16:
            return rough.float()  # float32 products: nothing was rounded
        # Named, not temporaries: each must outlive the call that reads its data.
        hidden32, rough, out = (hidden.float().contiguous(), rough.contiguous(),
                                torch.empty(rows, self.model.lm_head.n))
        code = self.lib.bw_head_logits(self.model, rows, hidden32.data_ptr(), rough.data_ptr(),
                                       out.data_ptr(), EXACT_TOP, threads)
        assert code == 0, f"bw_head_logits refused top {EXACT_TOP}"
        return out


class NativeAttention:
    """An Attention module's kernel (`attend`, models/llama.py) for the steps the torch path
    keeps (with adapters): those of decode rows only attend in decode.c, reading the paged
    cache in place, where the torch kernel gathers each group's blocks into new tensors per
    layer (48% of a 64-row step on the Intel Xeon of docs/performance.md). Steps with a prompt
    chunk go to the kernel it replaces."""

    def __init__(self, decoder: NativeDecoder, layer: int, fallback: AttendFn) -> None:
        self.decoder, self.layer, self.fallback = decoder, layer, fallback

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if not metadata.decode_only:
            return self.fallback(query, k_cache, v_cache, metadata, scale)
        return self.decoder.attend(self.layer, query, metadata)

    @staticmethod
    def install(decoder: NativeDecoder, model: LlamaForCausalLM) -> None:
        """Every attention layer of the model on the native kernel for decode-only steps."""
        for i, attention in enumerate(model.attention_layers()):
            attention.attend = NativeAttention(decoder, i, attention.attend)
