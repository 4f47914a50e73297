"""What the service holds once the model is up: the engine, the tokenizer and the limits every
front checks a request against."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.generation_config import GenerationConfig
from scheduler_svc.core.tool_calls import ToolCallFormat
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.service.lora_adapters import LoRAAdapters


@dataclasses.dataclass(slots=True)
class LoadedModel:
    """What the service needs once the model is up; fixed for the server's life."""

    engine: AsyncEngine
    tokenizer: Any
    config: SchedulerConfig
    model_name: str
    vocab_size: int
    # The engine's limits: the smaller of the scheduler's and the workers'.
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: list[int]
    dtype: str
    transport: str
    workers: Callable[[], list[Any]]  # the worker groups now, as model_loading.WorkerView
    task: str = "generate"  # what the workers serve: "generate" or "embed"
    pooling_type: str = ""  # on an embedding server
    hidden_size: int = 0  # an embedding's length without `dimensions`
    # A text or chat prompt longer than this cannot fit max_model_len tokens (0 = no bound).
    max_prompt_chars: int = 0
    # The defaults of a request's unset sampling fields (the model's generation config).
    generation_config: GenerationConfig = GenerationConfig({}, "none")
    weights: str = ""  # how the weights are stored and served, for GetModelInfo
    # The syntax tool_choice "auto" reads the model's calls in (--tool-call-parser, else the
    # chat template's); None: auto is refused.
    tool_format: ToolCallFormat | None = None
    # The LoRA adapters served by name: the one thing here that changes while serving (loads
    # and unloads, on the event loop).
    loras: LoRAAdapters = dataclasses.field(default_factory=lambda: LoRAAdapters(0, 1))

    def batch_invariant(self) -> bool:
        """Whether every worker group now serving runs in batch-invariant mode: a request's
        tokens do not depend on its neighbours only if no replica it may land on lets them."""
        workers = self.workers()
        return bool(workers) and all(w.batch_invariant for w in workers)
