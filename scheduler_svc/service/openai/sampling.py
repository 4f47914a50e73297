"""An OpenAI request's sampling fields as the gRPC `SamplingParams` message.

Only the shape changes here (a `stop` string becomes a list, `logit_bias` keys become token ids,
`response_format` becomes a constraint); every value is checked by the admission path that
gRPC requests take. A value the message cannot hold (an int32 out of range, a negative seed) is
refused here, naming the HTTP field, since protobuf itself refuses it.
"""

from __future__ import annotations

import json
from typing import Any

from batchwire.v1 import generate_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.service.openai.protocol import ResponseFormat, SamplingFields

# Fields spelled the same in both APIs.
_SAME = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "ignore_eos", "include_stop_str_in_output",
         "skip_special_tokens", "truncate_prompt_tokens", "n")
_LISTS = ("stop_token_ids", "bad_words", "allowed_token_ids")


def put(msg: Any, field: str, value: Any, param: str | None = None) -> None:
    """msg.field = value, or a 400 naming param when protobuf cannot hold the value."""
    try:
        if isinstance(value, list):
            getattr(msg, field).extend(value)
        else:
            setattr(msg, field, value)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(param or field, f"{value!r} is out of range ({e})") from None


def sampling_message(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> generate_pb2.SamplingParams:
    msg = generate_pb2.SamplingParams()
    for field in _SAME:
        value = getattr(body, field)
        if value is not None:
            put(msg, field, value)
    if max_tokens is not None:
        put(msg, "max_tokens", max_tokens)
    if logprobs is not None:
        put(msg, "logprobs", logprobs)
    if prompt_logprobs is not None:
        put(msg, "prompt_logprobs", prompt_logprobs)
    if body.stop is not None:
        put(msg, "stop", [body.stop] if isinstance(body.stop, str) else list(body.stop))
    for field in _LISTS:
        if getattr(body, field):
            put(msg, field, list(getattr(body, field)))
    if body.logit_bias:
        for key, bias in body.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError("logit_bias", f"key {key!r} is not a token id") from None
            try:
                msg.logit_bias[token] = bias
            except (ValueError, TypeError) as e:
                raise InvalidRequestError("logit_bias", f"{key!r}: {e}") from None
    if body.response_format is not None:
        constrain(msg, body.response_format)
    return msg


def constrain(msg: generate_pb2.SamplingParams, fmt: ResponseFormat) -> None:
    """response_format as the structured-output constraint (compiled at admission)."""
    if fmt.type == "json_object":
        msg.json_object = True
    elif fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema",
                                      "type json_schema needs json_schema.schema")
        msg.json_schema = json.dumps(fmt.json_schema.schema_)
