"""One worker per device: loads the model, sizes and allocates the KV cache, owns the runner."""

from __future__ import annotations

import logging
from typing import cast

import torch
from batchwire.common.model_files import model_name, resolve_model_path
from batchwire.common.worker_config import WorkerConfig
from batchwire.v1 import worker_pb2

from kernels.kv_cache import kv_cache_zeros
from worker_svc.loaders.weights import load_model
from worker_svc.model_runner import ModelRunner
from worker_svc.models.llama import Attention, LlamaForCausalLM
from worker_svc.parallel import TensorParallel, init_distributed

logger = logging.getLogger(__name__)


def kv_cache_block_bytes(model: LlamaForCausalLM, config: WorkerConfig) -> int:
    cfg = model.config
    element = torch.empty(0, dtype=getattr(torch, config.dtype)).element_size()
    # Sized by the largest rank share, so every rank of an uneven split has the same block count.
    kv_heads = -(-cfg.num_kv_heads // model.tp.size)
    return 2 * cfg.num_layers * config.block_size * kv_heads * cfg.head_dim * element


def allocate_kv_cache(model: LlamaForCausalLM, config: WorkerConfig) -> int:
    """Gives every attention layer its K and V cache; returns the number of blocks."""
    num_blocks = config.kv_cache_memory_bytes // kv_cache_block_bytes(model, config)
    # The null block plus one whole max_model_len request must fit, or nothing could ever run.
    needed = 1 + config.max_num_blocks_per_req
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds {num_blocks} blocks; "
            f"max_model_len={config.max_model_len} needs at least {needed}"
        )
    cfg = model.config
    shape = (num_blocks, config.block_size, model.plan.num_kv_heads, cfg.head_dim)
    for layer in model.layers:
        attn = cast(Attention, layer.self_attn)
        attn.k_cache = kv_cache_zeros(*shape, getattr(torch, config.dtype), config.device)
        attn.v_cache = kv_cache_zeros(*shape, getattr(torch, config.dtype), config.device)
    return int(num_blocks)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.tp = TensorParallel(config.rank, config.tensor_parallel_size)
        init_distributed(self.tp, config.distributed_init_method, config.device)
        self.model = load_model(
            self.model_path, getattr(torch, config.dtype), config.device, config.max_model_len,
            self.tp,
        )
        self.num_blocks = allocate_kv_cache(self.model, config)
        self.runner = ModelRunner(config, self.model, self.num_blocks)
        logger.info(
            "worker ready: %s, %d KV blocks of %d",
            self.model_path,
            self.num_blocks,
            config.block_size,
        )

    def get_info(self) -> worker_pb2.WorkerInfo:
        cfg = self.model.config
        return worker_pb2.WorkerInfo(
            model_name=model_name(self.model_path),
            vocab_size=cfg.vocab_size,
            max_model_len=self.config.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            dtype=self.config.dtype,
            device=self.config.device,
            tensor_parallel_size=self.tp.size,
            rank=self.tp.rank,
            max_num_reqs=self.config.max_num_reqs,
            eos_token_ids=list(cfg.eos_token_ids),
        )

    def execute_model(self, so: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput | None:
        return self.runner.execute_model(so)

    def sample_tokens(
        self, grammar: worker_pb2.GrammarOutput | None
    ) -> worker_pb2.ModelRunnerOutput:
        return self.runner.sample_tokens(grammar)

    def reset(self) -> None:
        self.runner.reset()
