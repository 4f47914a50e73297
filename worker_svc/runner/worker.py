"""One worker per device: loads the model, sizes and allocates the KV cache, owns the runner."""

from __future__ import annotations

import logging

import torch
from batchwire.common.model_files import describe_weights, model_name, resolve_model_path
from batchwire.common.worker_config import WorkerConfig
from batchwire.kernels.kv_cache import kv_cache_zeros
from batchwire.v1 import worker_pb2

from worker_svc.batch_invariant import enable as enable_batch_invariant
from worker_svc.loaders.weights import load_model
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.native.decoder import NativeAttention, NativeDecoder
from worker_svc.parallel.tensor_parallel import init_distributed, leave_distributed_group
from worker_svc.quant.blocks import QuantizedWeight
from worker_svc.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def kv_cache_block_bytes(model: LlamaForCausalLM, config: WorkerConfig) -> int:
    cfg = model.config
    element = torch.empty(0, dtype=getattr(torch, config.dtype)).element_size()
    # Sized by the largest rank share, so every rank of an uneven split has the same block count.
    kv_heads = -(-cfg.num_kv_heads // model.tp.size)
    # A pipeline stage caches its own layers only: stages of unequal depth get different counts.
    num_layers = model.stage.num_layers
    return 2 * num_layers * config.block_size * kv_heads * cfg.head_dim * element


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
    for attn in model.attention_layers():
        attn.k_cache = kv_cache_zeros(*shape, getattr(torch, config.dtype), config.device)
        attn.v_cache = kv_cache_zeros(*shape, getattr(torch, config.dtype), config.device)
    return int(num_blocks)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.tp = init_distributed(
            config.rank,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.distributed_init_method,
            config.device,
        )

        def build_native(model: LlamaForCausalLM, stored: dict[str, QuantizedWeight]) -> None:
            # A plain attribute: the cast to the serving dtype that follows leaves it alone.
            native = model.native = NativeDecoder.build(model, stored, config.max_model_len)
            if native is not None:  # the torch path's decode steps (adapters) attend natively
                NativeAttention.install(native, model)

        # The native decode step serves a whole model's quantized weights, unsharded.
        serves_native = (config.cpu_decode == "native" and config.served_quantization == "native"
                         and config.pipeline_parallel_size == 1)
        self.model, served = load_model(
            self.model_path,
            getattr(torch, config.dtype),
            config.device,
            config.max_model_len,
            self.tp,
            (config.pp_rank, config.pipeline_parallel_size),
            config.served_quantization,
            build_native if serves_native else None,
        )
        if isinstance(self.model.native, NativeDecoder):
            served += f"; {self.model.native.describe()}"
        self.weights = describe_weights(self.model_path, config.dtype, served)
        if config.batch_invariant:
            enable_batch_invariant(self.model)
        self.num_blocks = allocate_kv_cache(self.model, config)
        self.runner = ModelRunner(config, self.model, self.num_blocks)
        logger.info(
            "worker ready: %s, layers [%d, %d), %d KV blocks of %d",
            self.model_path,
            *self.model.stage.layers,
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
            rank=self.config.rank,
            max_num_reqs=self.config.max_num_reqs,
            eos_token_ids=list(cfg.eos_token_ids),
            pipeline_parallel_size=self.config.pipeline_parallel_size,
            pp_rank=self.config.pp_rank,
            tp_rank=self.tp.rank,
            output_rank=self.config.output_rank,
            task=self.config.task,
            pooling_type=self.config.pooling_type if self.config.task == "embed" else "",
            hidden_size=cfg.hidden_size,
            normalize=self.config.normalize,
            batch_invariant=self.config.batch_invariant,
            max_loras=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            weights=self.weights,
            quantization=self.config.quantization,
        )

    @property
    def is_output_rank(self) -> bool:
        """The rank whose replies the scheduler reads (TP rank 0 of the last stage)."""
        return self.config.rank == self.config.output_rank

    def execute_model(self, so: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput | None:
        return self.runner.execute_model(so)

    def sample_tokens(
        self, grammar: worker_pb2.GrammarOutput | None
    ) -> worker_pb2.ModelRunnerOutput:
        return self.runner.sample_tokens(grammar)

    def reset(self) -> None:
        self.runner.reset()

    # The external launcher (torchrun): every rank runs the engine, and agrees through these.

    def share_output(
        self, out: worker_pb2.ModelRunnerOutput | None
    ) -> worker_pb2.ModelRunnerOutput | None:
        """Every rank returns the output rank's result (torch.distributed broadcast), so that
        each rank's scheduler sees the same tokens: pipeline stages before the last sample
        nothing of their own."""
        if self.config.world_size == 1:
            return out
        import torch.distributed as dist

        mine = out.SerializeToString() if self.is_output_rank and out is not None else None
        payload = [mine]
        dist.broadcast_object_list(payload, src=self.config.output_rank)
        if self.is_output_rank:
            return out
        return None if payload[0] is None else worker_pb2.ModelRunnerOutput.FromString(payload[0])

    def leave_group(self) -> None:
        """Leaves torch.distributed's group with the other ranks (all call it together: the
        external launcher's ranks, as they shut down in step)."""
        leave_distributed_group()

    def group_infos(self) -> list[worker_pb2.WorkerInfo]:
        """Every rank's WorkerInfo, in rank order (stages may hold different block counts)."""
        mine = self.get_info()
        if self.config.world_size == 1:
            return [mine]
        import torch.distributed as dist

        gathered: list = [None] * self.config.world_size
        dist.all_gather_object(gathered, mine.SerializeToString())
        return [worker_pb2.WorkerInfo.FromString(b) for b in gathered]
