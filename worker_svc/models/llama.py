"""A Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) over a paged KV cache.

Tokens of all requests arrive flattened on one axis: x is (T, hidden), T = tokens this step.
The projections are fused (q|k|v and gate|up) so each layer makes two fewer matmul calls.
Under pipeline parallelism a model object is one stage: its own layers only, the embedding on the
first stage, the final norm and the LM head on the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from batchwire import kernels
from torch import nn

from worker_svc.model_config import ModelConfig
from worker_svc.models.forward_context import get_attention_metadata, get_lora_mask
from worker_svc.models.lora_linear import LoRAStack
from worker_svc.models.rotary import cos_sin_cache
from worker_svc.models.step_ops import StepTables, rms_norm
from worker_svc.parallel.pipeline import IntermediateTensors, PipelineStage
from worker_svc.parallel.tensor_parallel import ShardPlan, TensorParallel

# (query, k_cache, v_cache, metadata, scale) -> attention output, as kernels.paged_attention
AttendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, kernels.AttentionMetadata, float], torch.Tensor
]


class DecodeStep(Protocol):
    """The native CPU step (worker_svc/native/decoder.py's NativeDecoder): every layer of a
    step of up to max_rows decode rows in one call (decode), every layer of the other steps it
    serves with torch's products and the rest in C (between), and the LM head: the stored one
    in C up to max_rows rows, past that the model's own with each row's top logits exact."""

    max_rows: int

    def decode(self, embedded: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor: ...

    def serves(self, metadata: kernels.AttentionMetadata) -> bool: ...

    def between(self, embedded: torch.Tensor, positions: torch.Tensor,
                metadata: kernels.AttentionMetadata) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor: ...


def with_lora(stack: LoRAStack | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = base(x), plus each token's adapter delta when the model serves adapters this step."""
    if stack is None:
        return y
    mask = get_lora_mask()
    return y if mask is None else stack.add_delta(x, y, mask)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Under tensor parallelism: this rank's heads only (column-parallel q|k|v, row-parallel o)."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, plan: ShardPlan, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            plan.num_q_heads,
            plan.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Set once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The attention kernel; batch-invariant mode swaps in its own (worker_svc/batch_invariant).
        self.attend: AttendFn = kernels.paged_attention
        # Set by LlamaForCausalLM.enable_lora: every adapter slot's q|k|v and o matrices.
        self.qkv_lora: LoRAStack | None = None
        self.o_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, step: StepTables) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = with_lora(self.qkv_lora, x, self.qkv_proj(x))  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, nh, hs)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, nkv, hs)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, nkv, hs)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not step.fused:
            q, k = kernels.rotary_embedding(step.positions, q, k, step.cos_sin)
        elif self.q_norm is None:  # q and k, adjacent in q|k|v, turned by one call
            step.rotate(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim))
        else:
            step.rotate(q)
            step.rotate(k)
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        metadata = get_attention_metadata()
        step.write_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
        out = self.attend(q, self.k_cache, self.v_cache, metadata, self.scale)
        out = out.reshape(num_tokens, self.q_size)
        return self.tp.all_reduce(with_lora(self.o_lora, out, self.o_proj(out)))


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism, this rank's slice of the intermediate dimension."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = plan.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_lora: LoRAStack | None = None  # set by LlamaForCausalLM.enable_lora
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = with_lora(self.gate_up_lora, x, self.gate_up_proj(x))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up
        return self.tp.all_reduce(with_lora(self.down_lora, h, self.down_proj(h)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, plan: ShardPlan, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, plan, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, plan, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the norm: residual = x + residual; x = norm(residual).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, step)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int,
        tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage.build(cfg.num_layers)
        self.plan = ShardPlan.build(cfg, self.tp)
        first, last = self.stage.is_first, self.stage.is_last
        # Vocabulary-parallel: each rank holds the rows of its slice of the vocabulary.
        # Given its (uninitialised) weight: the loader overwrites it, and Embedding's own random
        # init on the meta device imports torch._dynamo, 1-2 s of every worker's start.
        self.embed_tokens = nn.Embedding(
            self.plan.vocab_size, cfg.hidden_size,
            _weight=torch.empty(self.plan.vocab_size, cfg.hidden_size)) if first else None
        # Keyed by the model-wide layer index, so that parameter names are the checkpoint's on
        # every stage ("layers.17.mlp...").
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i, self.plan, self.tp) for i in range(*self.stage.layers)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        self.lm_head = (
            nn.Linear(cfg.hidden_size, self.plan.vocab_size, bias=False) if last else None
        )
        self.tie_weights()
        self.max_position = max_position
        self.cos_sin = torch.empty(0)  # filled by init_rotary(), once the weights have a device
        # The native CPU step (worker_svc/native), set by the Worker where it serves: steps
        # without adapters run there (a few decode rows in one call); the rest runs below.
        self.native: DecodeStep | None = None

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the checkpoint ties them.

        Called again after Module.to_empty(), which gives each parameter its own storage. A last
        stage without the embedding loads the tied matrix into its LM head instead.
        """
        embed, head = self.embed_tokens, self.lm_head
        if self.config.tie_word_embeddings and embed is not None and head is not None:
            head.weight = embed.weight

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers.values()]

    def attention_layers(self) -> list[Attention]:
        """This stage's attention modules in layer order; each holds its layer's KV cache."""
        return [layer.self_attn for layer in self.decoder_layers()]

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Gives each projection of each layer its (zeroed) adapter slots, in the weights' dtype."""
        if self.tp.enabled:
            raise ValueError("LoRA adapters are served without tensor parallelism only")
        cfg, param = self.config, next(self.parameters())
        hidden, inter = cfg.hidden_size, self.plan.intermediate_size

        def stack(in_features: int, out_sizes: list[int]) -> LoRAStack:
            return LoRAStack(in_features, out_sizes, max_loras, max_rank, param.dtype, param.device)

        for layer in self.layers.values():
            attn, mlp = cast(DecoderLayer, layer).self_attn, cast(DecoderLayer, layer).mlp
            attn.qkv_lora = stack(hidden, [attn.q_size, attn.kv_size, attn.kv_size])
            attn.o_lora = stack(attn.q_size, [hidden])
            mlp.gate_up_lora = stack(hidden, [inter, inter])
            mlp.down_lora = stack(inter, [hidden])

    def init_rotary(self, device: torch.device | str) -> None:
        # A plain attribute, not a buffer, so model.to(bfloat16) leaves it in float32: rotary
        # angles at large positions lose too much precision in bfloat16.
        cfg = self.config
        table = cos_sin_cache(cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin = table.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: (T,) -> hidden states (T, hidden) after the final norm.

        A later stage starts from the previous stage's `intermediate` instead of the tokens; a
        stage before the last returns its stream, un-normalised, for the next one.
        """
        if self.native is not None and intermediate is None:
            metadata = get_attention_metadata()
            rows = metadata.num_reqs
            if self._native_serves(input_ids, metadata):
                if metadata.decode_only and rows <= self.native.max_rows:
                    return self.native.decode(self._embed(input_ids), positions,
                                              metadata.block_table[:rows],
                                              metadata.seq_lens[:rows])
                if self.native.serves(metadata):
                    return self.native.between(self._embed(input_ids), positions, metadata)
        residual = None
        if intermediate is None:
            x = self._embed(input_ids)
        else:
            x, residual = intermediate.hidden, intermediate.residual
        step = StepTables.build(positions, self.cos_sin, self.config.head_dim)
        for layer in self.layers.values():
            x, residual = layer(x, residual, step)
        if self.norm is None:
            assert residual is not None, "a stage holds at least one layer"
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x

    @staticmethod
    def _native_serves(input_ids: torch.Tensor, metadata: kernels.AttentionMetadata) -> bool:
        """Whether the native step takes this step: no adapter, no padding tokens."""
        return input_ids.shape[0] == metadata.num_actual_tokens and get_lora_mask() is None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first stage embeds tokens"
        if not self.tp.enabled:
            return self.embed_tokens(input_ids)
        start, end = self.plan.vocab
        mine = (input_ids >= start) & (input_ids < end)
        local = torch.where(mine, input_ids - start, 0)
        x = self.embed_tokens(local) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)  # each token's row came from exactly one rank

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (R, hidden) -> logits (R, vocab) in float32, the full vocabulary on every rank.

        Every rank then samples the same tokens from the same logits, so ranks stay in step.
        """
        assert self.lm_head is not None, "only the last stage computes logits"
        if self.native is not None:  # the stored head (Q8_0 as it is) sets the top logits
            return self.native.logits(hidden, self.lm_head)
        logits = self.lm_head(hidden).float()
        return self.tp.all_gather_last_dim(logits, self.plan.vocab_sizes)
