"""The Generation service's edge: protobuf messages in, plain objects out, and back.

Every InvalidRequestError raised here names the field as the client spelled it on the wire
(`sampling.top_p`, `token_ids`), so that the status message points at the client's own field.
"""

from __future__ import annotations

import uuid
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.chat_template import chat_prompt_ids
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.generation_config import GenerationConfig
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.structured_output import compiler_for
from scheduler_svc.core.tool_calls import ToolPlan, tool_conversation
from scheduler_svc.service.tool_wire import conversation

# SamplingParams fields a client may set, all `optional` on the wire: unset = the model's
# generation config where it has the field, else the dataclass default.
_SCALAR_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens", "n",
    "prompt_logprobs",
)
_LIST_FIELDS = ("stop", "stop_token_ids", "bad_words")
_PROMPT_FIELDS = ("text", "token_ids", "messages")
MAX_REQUEST_ID_CHARS = 256
# Longer prompts are tokenized on a thread, not the event loop: the tokenizer releases the GIL,
# so a megabyte of text no longer holds up every other stream (a 10 MB one stalled them 9.6 s).
OFF_LOOP_CHARS = 4096


def invalid(field: str, engine_error: InvalidRequestError) -> InvalidRequestError:
    """The engine's error, renamed to the wire field; the engine's name stays when it differs."""
    if engine_error.field == field:
        return engine_error
    return InvalidRequestError(f"{field} ({engine_error.field})", engine_error.message)


def sampling_params(msg: generate_pb2.SamplingParams,
                    generation: GenerationConfig | None = None) -> SamplingParams:
    """The request's fields; an unset one takes the model's generation config, if it has that
    field, else SamplingParams' default."""
    kwargs: dict[str, Any] = {f: getattr(msg, f) for f in _SCALAR_FIELDS if msg.HasField(f)}
    if generation is not None:
        kwargs = generation.apply(kwargs)
    kwargs.update({f: list(getattr(msg, f)) for f in _LIST_FIELDS})
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:  # empty is unset on the wire
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    kind = msg.WhichOneof("constraint")
    if kind == "choice":
        kwargs[kind] = list(msg.choice.choices)
    elif kind is not None:
        kwargs[kind] = getattr(msg, kind)
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"sampling.{e.field}", e.message) from None


def add_echo(msg: generate_pb2.GenerateResponse, ids: list[int], tokenizer: Any) -> None:
    msg.prompt_token_ids.extend(ids)
    msg.prompt_text = tokenizer.decode(ids, skip_special_tokens=False)


def check_priority(priority: int, policy: str) -> None:
    """A priority means something only under the priority policy; elsewhere it is refused
    rather than silently ignored."""
    if priority and policy != "priority":
        raise InvalidRequestError("priority", f"{priority} needs the server's priority policy "
                                              f"(--policy priority); it runs {policy!r}")


def request_id(msg: generate_pb2.GenerateRequest) -> str:
    if not msg.request_id:
        return uuid.uuid4().hex
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"{len(msg.request_id)} characters, at most "
                                                f"{MAX_REQUEST_ID_CHARS} allowed")
    return msg.request_id


def prompt_field(msg: Any) -> str:
    """Which one of text / token_ids / messages the request set; refuses none or several."""
    present = [f for f in _PROMPT_FIELDS if _is_set(msg, f)]
    if len(present) != 1:
        given = ", ".join(present) if present else "none"
        fields = [f for f in _PROMPT_FIELDS if f in msg.DESCRIPTOR.fields_by_name]
        raise InvalidRequestError("prompt", f"set exactly one of {', '.join(fields)} "
                                            f"(got {given})")
    return present[0]


def _is_set(msg: Any, field: str) -> bool:
    if field not in msg.DESCRIPTOR.fields_by_name:
        return False
    return msg.HasField(field) if field == "text" else len(getattr(msg, field)) > 0


def prompt_chars(msg: Any) -> int:
    """Characters of a text or chat prompt (the messages' contents), 0 for token ids."""
    field = prompt_field(msg)
    if field == "text":
        return len(msg.text)
    if field != "messages":
        return 0
    calls = sum(len(c.arguments) for m in msg.messages for c in m.tool_calls)
    tools = sum(len(t.description) + len(t.parameters) for t in getattr(msg, "tools", ()))
    return sum(len(m.content) for m in msg.messages) + calls + tools


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token spells (a byte-level vocabulary's entries
    are at least as long as their text)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_prompt_chars(msg: Any, max_chars: int, max_model_len: int) -> None:
    """Refuses a prompt that is too long in characters to fit max_model_len tokens whatever
    its tokens, before the tokenizer spends seconds on it (0 = no bound)."""
    chars = prompt_chars(msg)
    if max_chars and chars > max_chars:
        raise InvalidRequestError(prompt_field(msg), f"{chars} characters cannot fit "
                                  f"max_model_len={max_model_len} tokens: the limit is "
                                  f"{max_chars} characters (send token_ids to truncate)")


def tokenize(msg: Any, tokenizer: Any, add_special_tokens: bool | None = None,
             tools: ToolPlan | None = None) -> tuple[str, list[int]]:
    """(the prompt field the request set, its token ids); nothing checked against the model.
    `tools`: what a chat prompt shows of them, and the syntax earlier calls are written in."""
    field = prompt_field(msg)
    if field == "text":
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return field, list(tokenizer(msg.text, **kwargs).input_ids)
    if field == "messages":
        return field, chat_token_ids(tokenizer, msg.messages, tools)
    return field, list(msg.token_ids)


def detokenize(msg: generate_pb2.DetokenizeRequest, tokenizer: Any, vocab_size: int) -> str:
    bad = [t for t in msg.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError("token_ids", f"{bad[0]} is outside the vocabulary "
                                               f"[0, {vocab_size})")
    skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
    return str(tokenizer.decode(list(msg.token_ids), skip_special_tokens=skip))


def admission_error(error: InvalidRequestError, prompt: str) -> InvalidRequestError:
    """The scheduler's refusal, with the field the client set on the wire: `prompt` is the prompt
    field it used (text, token_ids or messages), sampling fields get their `sampling.` prefix."""
    if error.field == "prompt_token_ids":
        return invalid("token_ids", error)
    if error.field == "prompt":
        return invalid(prompt, error)
    if error.field == "request_id":
        return error
    return InvalidRequestError(f"sampling.{error.field}", error.message)


def chat_token_ids(tokenizer: Any, messages: Any, tools: ToolPlan | None = None) -> list[int]:
    turns, template_tools = tool_conversation(
        conversation(messages), tools.tools if tools else [], tools.fmt if tools else None,
        getattr(tokenizer, "chat_template", None))
    return chat_prompt_ids(tokenizer, turns, tools=template_tools)


def compile_constraint(params: SamplingParams, tokenizer: Any, vocab_size: int) -> None:
    """Compiles the request's constraint into the shared cache, where the scheduler finds it.
    Blocking: a large schema takes a while, so the servicer runs it on a worker thread."""
    if params.constraint is None:
        return
    try:
        compiler_for(tokenizer, vocab_size).compile(params.constraint)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"sampling.{e.field}", e.message) from None


def response(request_id: str, out: EngineCoreOutput, usage: bool = False
             ) -> generate_pb2.GenerateResponse:
    """One output as a message; usage on the last one, or on every one when `usage`."""
    msg = generate_pb2.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids,
                                        text=out.new_text)
    for lp in out.prompt_logprobs or ():
        entry = msg.prompt_logprobs.add(token_id=lp.token_ids[0], logprob=lp.logprobs[0],
                                        rank=lp.sampled_token_rank)
        for token_id, logprob in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True):
            entry.top_logprobs.add(token_id=token_id, logprob=logprob)
    for lp in out.new_logprobs or ():
        entry = msg.logprobs.add(token_id=lp.token_ids[0], logprob=lp.logprobs[0],
                                 rank=lp.sampled_token_rank)
        for token_id, logprob in zip(lp.token_ids[1:], lp.logprobs[1:], strict=True):
            entry.top_logprobs.add(token_id=token_id, logprob=logprob)
    if out.finished:
        msg.finish_reason = out.finish_reason or "stop"
        if isinstance(out.stop_reason, str):
            msg.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            msg.stop_token_id = out.stop_reason
    if out.finished or usage:
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_tokens = out.num_cached_tokens
        msg.usage.total_tokens = out.num_prompt_tokens + out.num_output_tokens
    return msg
