"""One generation request as one plain, validated object, made once at the service edge.

The gRPC front turns a `GenerateRequest` into a GenerationRequest in one call (`parse`); the HTTP
front, whose prompts it tokenizes itself, builds the same object (`for_http`). Both then admit it
through `GenerationServicer.admit`, where only the scheduler's own checks remain (vocabulary,
max_model_len, logprobs: it knows its worker group's limits). Every check here raises
InvalidRequestError naming the field as the gRPC client spelled it; the HTTP front renames.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError, WrongTaskError
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.tool_calls import ToolPlan
from scheduler_svc.service import wire
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.tool_wire import constrain, tool_plan


@dataclasses.dataclass(slots=True)
class GenerationRequest:
    """What admission takes: nothing in it is protobuf, and every value in it is checked."""

    request_id: str  # the client's; a fresh one when it sent none
    prompt_ids: list[int]  # the prompt as tokenized or given, before truncate_prompt_tokens
    prompt_field: str  # the prompt's wire field (text, token_ids, messages): errors name it
    params: SamplingParams  # the generation config's defaults applied, its constraint compiled
    priority: int = 0  # nonzero only under the priority policy
    cache_salt: str | None = None
    echo: bool = False  # the stream's first message carries the prompt as run
    continuous_usage: bool = False  # every message carries the usage so far
    # The request's tools: what its reply is read for (auto, or a constrained call).
    tools: ToolPlan | None = None
    lora: LoRARequest | None = None  # the adapter it names; None = the base model

    @property
    def reads_tool_calls(self) -> bool:
        return self.tools is not None and (self.tools.parses or self.tools.constrained)

    @property
    def prompt_as_run(self) -> list[int]:
        """The prompt the scheduler runs: its last truncate_prompt_tokens tokens when set."""
        k = self.params.truncate_prompt_tokens
        return self.prompt_ids[-k:] if k is not None else self.prompt_ids


async def parse(msg: generate_pb2.GenerateRequest, m: LoadedModel) -> GenerationRequest:
    """A Generate call's request, checked in the order its errors have always come: the task,
    the id, the sampling fields, n and priority, the prompt's size, then its constraint."""
    check_task(m, msg.HasField("sampling"))
    request_id = wire.request_id(msg)
    tools = tool_plan(msg, m.tool_format)
    sampling = msg.sampling
    if tools.constrained or tools.tagged:  # the tools' constraint joins the sampling fields
        sampling = generate_pb2.SamplingParams()
        sampling.CopyFrom(msg.sampling)
        await constrain(tools, sampling, f"sampling.{sampling.WhichOneof('constraint')}")
    params = _sampling(sampling, msg.priority, m)
    wire.check_prompt_chars(msg, m.max_prompt_chars, m.max_model_len)
    field, ids = await tokenized(msg, m.tokenizer, tools=tools)
    await _compile(params, m)
    lora = m.loras.resolve(msg.lora_name)  # NOT_FOUND for a name not loaded
    return GenerationRequest(request_id, ids, field, params, msg.priority,
                             msg.cache_salt or None, msg.sampling.echo,
                             msg.sampling.continuous_usage, tools, lora)


async def for_http(request_id: str, prompt_ids: list[int], sampling: generate_pb2.SamplingParams,
                   m: LoadedModel, priority: int = 0, cache_salt: str | None = None,
                   lora_name: str = "") -> GenerationRequest:
    """The HTTP front's request: its prompt already tokenized (prompt_token_ids), its sampling
    fields in Generate's message, whose range checks it shares (openai/sampling.py)."""
    check_task(m, True)
    params = _sampling(sampling, priority, m)
    await _compile(params, m)
    return GenerationRequest(request_id, prompt_ids, "token_ids", params, priority,
                             cache_salt or None, lora=m.loras.resolve(lora_name))


def check_task(m: LoadedModel, sampling_set: bool) -> None:
    if m.task != "generate":
        if sampling_set:  # a generation field: name it
            raise InvalidRequestError("sampling", f"this server runs a {m.task!r} model, "
                                                  "which samples nothing; use Embed")
        raise WrongTaskError(f"Generate: this server runs a {m.task!r} model; use Embed")


def _sampling(msg: generate_pb2.SamplingParams, priority: int, m: LoadedModel
              ) -> SamplingParams:
    params = wire.sampling_params(msg, m.generation_config)
    if params.n > m.config.max_n:
        raise InvalidRequestError("sampling.n", f"{params.n} is above the server's max_n "
                                                f"({m.config.max_n})")
    wire.check_priority(priority, m.config.policy)
    return params


async def _compile(params: SamplingParams, m: LoadedModel) -> None:
    if params.constraint is not None:
        # Neither the event loop nor the engine thread waits for a large schema to compile.
        await asyncio.get_running_loop().run_in_executor(
            None, wire.compile_constraint, params, m.tokenizer, m.vocab_size)


async def prompt_token_ids(msg: Any, m: LoadedModel, tools: ToolPlan | None = None
                           ) -> list[int]:
    """A text or chat prompt's ids, for the HTTP front: refused when too long to fit,
    tokenized off the event loop when long."""
    wire.check_prompt_chars(msg, m.max_prompt_chars, m.max_model_len)
    return (await tokenized(msg, m.tokenizer, tools=tools))[1]


async def tokenized(msg: Any, tokenizer: Any, add_special_tokens: bool | None = None,
                    tools: ToolPlan | None = None) -> tuple[str, list[int]]:
    """(the prompt's wire field, its token ids); a long prompt is tokenized on a thread."""
    if wire.prompt_chars(msg) <= wire.OFF_LOOP_CHARS:
        return wire.tokenize(msg, tokenizer, add_special_tokens, tools)
    return await asyncio.get_running_loop().run_in_executor(
        None, wire.tokenize, msg, tokenizer, add_special_tokens, tools)
