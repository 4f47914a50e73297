"""The engine loop: one step = schedule, run the model, read the tokens back.

It owns a scheduler (this process) and an executor (the way to the workers); it holds no model
and makes no decision of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executor import Executor
from scheduler_svc.outputs import EngineCoreOutput
from scheduler_svc.request import Request
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler


class EngineCore:
    """Not thread-safe: a server calls add_request, abort_requests and step from one thread."""

    def __init__(self, config: SchedulerConfig, executor: Executor | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.executor = executor if executor is not None else Executor.get_class(config)(config)
        info = self.executor.get_info()
        self.worker_info = info  # model name, vocabulary, limits: for GetModelInfo and logs
        eos = set(info.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            eos.add(tok_eos)
        self.scheduler = Scheduler(
            config,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            eos_token_ids=eos,
            max_model_len=info.max_model_len or None,
            max_num_seqs=info.max_num_reqs or None,
            tokenizer=tokenizer,
        )

    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    **kwargs: Any) -> Request:
        return self.scheduler.add_request(prompt_token_ids, sampling_params, **kwargs)

    def abort_requests(self, client_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(client_ids)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_requests():
            return []
        so = self.scheduler.schedule()
        future = self.executor.execute_model(so, non_block=True)
        grammar_output = self.scheduler.get_grammar_bitmask(so)  # CPU work beside the forward
        model_output = future.result()
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output)
        return self.scheduler.update_from_output(so, model_output)

    def shutdown(self) -> None:
        self.executor.shutdown()
