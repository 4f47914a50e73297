"""Pipeline parallelism: which layers a stage holds, and the hand-off of hidden states between
stages.

Every rank runs every step's diff and input layout itself (the persistent batch is the same on
every rank), so a stage knows how many tokens the previous one will send and needs no header:
the hand-off is one tensor, hidden states and residual stacked, sent by each TP rank of a stage
to the rank with the same TP rank in the next stage (after the stage's all-reduce, every TP rank
holds the whole hidden states).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from worker_svc.parallel.tensor_parallel import split_range


@dataclasses.dataclass(slots=True)
class IntermediateTensors:
    """What a non-final stage hands on: the stream after its last layer, before the final norm."""

    hidden: torch.Tensor  # (T, hidden)
    residual: torch.Tensor  # (T, hidden)


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineStage:
    rank: int = 0  # pp_rank: 0 embeds the tokens, size - 1 normalises and computes logits
    size: int = 1
    layers: tuple[int, int] = (0, 0)  # [start, end) of the model's layers held here
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def build(
        cls, num_layers: int, pp_rank: int = 0, pp_size: int = 1, tp_rank: int = 0, tp_size: int = 1
    ) -> PipelineStage:
        """Layers split as evenly as they go: the first num_layers % pp_size stages get one more."""
        if num_layers < pp_size:
            raise ValueError(
                f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers"
            )
        layers = split_range(num_layers, pp_rank, pp_size)
        return cls(pp_rank, pp_size, layers, tp_rank, tp_size)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def holds_layer(self, index: int) -> bool:
        return self.layers[0] <= index < self.layers[1]

    def _global_rank(self, pp_rank: int) -> int:
        return pp_rank * self.tp_size + self.tp_rank

    def send_next(self, out: IntermediateTensors) -> None:
        """Blocks until the next stage has the tensors (gloo) or they are queued (NCCL)."""
        packed = torch.stack([out.hidden, out.residual])  # (2, T, hidden)
        dist.send(packed.contiguous(), dst=self._global_rank(self.rank + 1))

    def recv_previous(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        packed = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(packed, src=self._global_rank(self.rank - 1))
        return IntermediateTensors(packed[0], packed[1])
