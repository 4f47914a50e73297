"""Loading the model for a server, describing what it serves, and the warm-up request that must
pass end to end before health says SERVING."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from batchwire.common.model_files import describe_weights
from tqdm import tqdm

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.generation_config import GenerationConfig
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.tokenizer import load_tokenizer
from scheduler_svc.core.tool_calls import choose_format
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.replicas import Replica, ReplicatedEngine
from scheduler_svc.executors.base import Executor
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.lora_adapters import LoRAAdapters
from scheduler_svc.service.wire import longest_token_chars


def version() -> str:
    try:
        return importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_model(config: SchedulerConfig, progress: bool = True, replicas: int = 1,
               executors: list[Executor] | None = None) -> tuple[ReplicatedEngine, Any]:
    """The tokenizer and an engine whose workers are loaded and hold their KV cache.

    A server always runs a ReplicatedEngine, even over one worker group: when that group fails,
    its requests end with UNAVAILABLE and the engine waits for a group to join, where an
    EngineCore would be gone for good."""
    # disable=None: no bar where stderr is not a terminal (a log file would get \r fragments).
    with tqdm(total=2, disable=None if progress else True,
              bar_format="{desc} ({n}/{total}) [{elapsed}]") as bar:
        bar.set_description_str("Loading the tokenizer")
        tokenizer = load_tokenizer(config.model)
        bar.update()
        bar.set_description_str("Loading the model and allocating the KV cache")
        # Configured addresses name the groups; otherwise each executor starts its own.
        if executors is None and not config.worker_addresses:
            executors = [Executor.get_class(config)(config) for _ in range(replicas)]
        core = ReplicatedEngine(config, executors, tokenizer=tokenizer)
        bar.update()
        bar.set_description_str("Loaded")
    return core, tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerView:
    address: str  # its ranks' addresses, comma-separated; "in-process" for the uni transport
    state: str  # "ready", "draining" or "failed"
    device: str
    tensor_parallel_size: int
    batch_invariant: bool  # started with --batch-invariant


def worker_view(replica: Replica) -> WorkerView:
    executor, info = replica.core.executor, replica.core.info
    addresses = executor.addresses or ["in-process"]
    state = "failed" if executor.failed else "draining" if replica.draining else "ready"
    return WorkerView(",".join(addresses), state, info.device, info.tensor_parallel_size or 1,
                      info.batch_invariant)


def describe(core: ReplicatedEngine, tokenizer: Any, engine: AsyncEngine,
             generation: GenerationConfig) -> LoadedModel:
    """The model as the first replica serves it; every replica that joins serves the same."""
    first = core.replicas[0].core
    scheduler, info = first.scheduler, first.info

    def workers() -> list[WorkerView]:  # replicas come and go while the engine serves
        return [worker_view(r) for r in list(core.replicas)]

    loras = LoRAAdapters(info.max_loras, info.max_lora_rank, info.model_name)
    for name, path in core.config.lora_modules:  # --lora-modules: a bad one stops the start
        loras.load(name, path)
    return LoadedModel(
        loras=loras, engine=engine, tokenizer=tokenizer, config=core.config,
        model_name=info.model_name,
        vocab_size=scheduler.vocab_size, max_model_len=scheduler.max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        eos_token_ids=sorted(scheduler.eos_token_ids), dtype=info.dtype,
        transport=first.executor.transport or "uni", workers=workers,
        task=first.scheduler.task, pooling_type=info.pooling_type, hidden_size=info.hidden_size,
        max_prompt_chars=scheduler.max_model_len * longest_token_chars(tokenizer),
        generation_config=generation,
        weights=info.weights or describe_weights(core.config.model, info.dtype),
        tool_format=choose_format(core.config.tool_call_parser,
                                  getattr(tokenizer, "chat_template", None)))


async def warm_up(engine: AsyncEngine, tokenizer: Any, task: str = "generate",
                  vocab_size: int | None = None) -> None:
    """One short request through every stage: scheduler, worker, sampler (or pooler),
    detokenizer."""
    ids = [i for i in tokenizer("Hello").input_ids if vocab_size is None or i < vocab_size]
    ids = ids or [0]
    pooling = PoolingParams() if task == "embed" else None
    stream = await engine.add_request("warm-up", ids, SamplingParams(temperature=0, max_tokens=2),
                                      pooling=pooling)
    async for _ in stream:
        pass


