"""Tensor parallelism: which slice of each weight a rank holds, and the collectives that join them.

Under pipeline parallelism each stage is a tensor-parallel group of its own (its ranks are
neighbours in the global numbering, rank = pp_rank * T + tp_rank); the stages' hand-offs are in
worker_svc/parallel/pipeline.py.

Heads are split by KV head, each KV head taking its group of query heads along, so a model whose
head counts do not divide by the group size (SmolLM2: 9 query / 3 KV heads at TP=2) still shards:
ranks get 2 and 1 KV heads. The MLP's intermediate dimension and the vocabulary split the same
way, as evenly as they go. The KV cache is sharded with the KV heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from worker_svc.model_config import ModelConfig


def split_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items; the first n % size ranks take one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0  # within this stage
    size: int = 1
    # The stage's ProcessGroup; None = the default group, which is the stage when there is one.
    group: Any = dataclasses.field(default=None, compare=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the partial results of a row-parallel layer across ranks, in place."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Joins each rank's slice of the last dimension; slices may differ in size by one."""
        if not self.enabled:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)


def init_distributed(
    rank: int, tp_size: int, pp_size: int, init_method: str, device: str
) -> TensorParallel:
    """Joins the group of all pp_size x tp_size ranks (gloo on CPU, NCCL on CUDA) and returns
    this rank's tensor-parallel group: the ranks of its stage."""
    world_size = tp_size * pp_size
    if world_size == 1:
        return TensorParallel()
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    group = None
    if pp_size > 1 and tp_size > 1:
        # new_group() is collective: every rank creates every stage's group, in the same order.
        for stage in range(pp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            created = dist.new_group(ranks)
            if rank in ranks:
                group = created
    return TensorParallel(rank % tp_size, tp_size, group)


def leave_distributed_group() -> None:
    """Every rank of the group leaves it together (a collective: call it on all ranks). Left to
    the interpreter's exit, gloo's teardown in one rank while a peer still sends can abort the
    process ('terminate called without an active exception', SIGABRT)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    """Where this rank's slice lies in each kind of full tensor."""

    kv_heads: tuple[int, int]  # [start, end) of KV heads
    q_heads: tuple[int, int]  # the query heads that attend to those KV heads
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: list[int]  # every rank's vocabulary slice, for the logits all-gather

    @classmethod
    def build(cls, cfg: ModelConfig, tp: TensorParallel) -> ShardPlan:
        if cfg.num_kv_heads < tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} exceeds the model's {cfg.num_kv_heads} KV heads"
            )
        group = cfg.num_heads // cfg.num_kv_heads
        kv = split_range(cfg.num_kv_heads, tp.rank, tp.size)
        sizes = [split_range(cfg.vocab_size, r, tp.size) for r in range(tp.size)]
        return cls(
            kv_heads=kv,
            q_heads=(kv[0] * group, kv[1] * group),
            intermediate=split_range(cfg.intermediate_size, tp.rank, tp.size),
            vocab=sizes[tp.rank],
            vocab_sizes=[end - start for start, end in sizes],
        )

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def shard(self, name: str, full: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's slice of a full (fused) model tensor named as in the model."""
        hd = cfg.head_dim
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q_end = cfg.num_heads * hd
            k_end = q_end + cfg.num_kv_heads * hd
            q, k, v = full[:q_end], full[q_end:k_end], full[k_end:]
            qs, qe = self.q_heads
            ks, ke = self.kv_heads
            return torch.cat([q[qs * hd : qe * hd], k[ks * hd : ke * hd], v[ks * hd : ke * hd]])
        if name.endswith("o_proj.weight"):
            qs, qe = self.q_heads
            return full[:, qs * hd : qe * hd]
        if name.endswith("gate_up_proj.weight"):
            s, e = self.intermediate
            gate, up = full.split(cfg.intermediate_size)
            return torch.cat([gate[s:e], up[s:e]])
        if name.endswith("down_proj.weight"):
            s, e = self.intermediate
            return full[:, s:e]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            s, e = self.vocab
            return full[s:e]
        return full  # norms are replicated
