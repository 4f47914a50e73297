"""The offline API: a batch of prompts in, finished requests out, on an engine in this process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.generation_config import load_generation_config
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.outputs import EngineCoreOutput, RequestOutput
from scheduler_svc.core.pooling import PoolingParams
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.tokenizer import load_tokenizer
from scheduler_svc.engine.engine_core import EngineCore
from scheduler_svc.executors.base import Executor

# A prompt is text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | dict


class LLM:
    """`LLM(model=None)` serves the embedded SmolLM2; any SchedulerConfig field is a keyword
    (`pipeline_parallel_size=P`, `task="embed"` with `pooling_type=...` for embed())."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16",
                 executor: Executor | None = None, tokenizer: Any = None, **config: Any) -> None:
        self.config = SchedulerConfig(model=model, dtype=dtype, **config)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self.generation_config = load_generation_config(model, self.config.generation_config)
        self.engine = EngineCore(self.config, executor, self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; results come back in the order of the prompts.

        `lora_request`: one adapter for every prompt, or one (or None: the base model) each."""
        batch = _as_batch(prompts)
        loras = _per_prompt(lora_request, len(batch))
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")

        results: dict[str, RequestOutput] = {}
        added = []
        try:
            for i, (prompt, params) in enumerate(zip(batch, sampling_params, strict=True)):
                text, ids = self._tokenize(prompt)
                request_id = f"llm-{next(self._ids)}"
                request = self.engine.add_request(ids, params, request_id=request_id,
                                                  priority=priority[i] if priority else 0,
                                                  lora=loras[i])
                added.append(request_id)
                # The scheduler's copy: truncate_prompt_tokens may have cut it.
                results[request_id] = RequestOutput(request_id, text,
                                                    list(request.prompt_token_ids))
            self._run(results, use_tqdm)
        finally:
            # An error mid-run must not leave requests behind to run in the next call.
            self.engine.abort_requests(added)
        return list(results.values())

    def default_sampling_params(self) -> SamplingParams:
        """The model's generation config over SamplingParams' defaults, as the server applies
        them to a request's unset fields."""
        return SamplingParams(**self.generation_config.defaults)

    def embed(self, texts: Prompt | Sequence[Prompt], normalize: bool | None = None,
              dimensions: int | None = None, use_tqdm: bool = False) -> list[list[float]]:
        """One vector per input (text or token ids), in input order; needs task="embed"."""
        batch = _as_batch(texts)
        pooling = PoolingParams(normalize, dimensions)
        results: dict[str, RequestOutput] = {}
        added = []
        try:
            for prompt in batch:
                text, ids = self._tokenize(prompt)
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(ids, SamplingParams(), request_id=request_id,
                                        pooling=pooling)
                added.append(request_id)
                results[request_id] = RequestOutput(request_id, text, list(ids))
            self._run(results, use_tqdm)
        finally:
            self.engine.abort_requests(added)
        return [cast(list[float], r.embedding) for r in results.values()]

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        # disable=None: no bar where stderr is not a terminal (a log would get \r fragments).
        with tqdm(total=len(results), desc="Generating", unit="req",
                  disable=None if use_tqdm else True) as bar:
            remaining = len(results)
            while remaining:
                for out in self.engine.step():
                    if out.request_id in results and _accumulate(results[out.request_id], out):
                        remaining -= 1
                        bar.update(1)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        return None, list(prompt)

    def collective_rpc(self, method: str | Any, args: tuple = ()) -> list[Any]:
        """Calls `method` on every rank's worker: a Worker method's name, or (in-process under
        the external launcher) a function called as method(worker, *args), e.g. to load new
        weights into every rank of a torchrun job; the results, in rank order (under the
        external launcher, this rank's)."""
        return self.engine.executor.collective_rpc(method, args)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} lora requests for {n} prompts")
    return loras


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]  # one prompt
    return list(cast(Sequence[Prompt], prompts))


def _accumulate(result: RequestOutput, out: EngineCoreOutput) -> bool:
    """Adds a step's delta to the request's result; True when the request finished."""
    result.token_ids.extend(out.new_token_ids)
    result.text += out.new_text
    if out.prompt_logprobs is not None:
        result.prompt_logprobs = out.prompt_logprobs
    if out.new_logprobs:
        result.logprobs = (result.logprobs or []) + out.new_logprobs
    if out.embedding is not None:
        result.embedding = out.embedding
    if out.finished:
        result.finish_reason = out.finish_reason
        result.stop_reason = out.stop_reason
        result.error = out.error
    return out.finished


__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]
