"""The request bodies the HTTP front accepts, as pydantic models (they make /openapi.json).

Types are checked here, strictly where OpenAI is strict: an integer field takes a JSON integer
(not "10", not 10.0, not true), a boolean field a JSON boolean (not "yes", not 1); integers must
fit the int32 the gRPC message holds, and logit_bias values lie within [-100, 100]. A failure is
a 400 naming the field. Values are not checked here otherwise: ranges and limits are the
admission path's, shared with gRPC. Fields that OpenAI defines and that change nothing here
(`user`, ...) are accepted and ignored, and so are unknown ones, as vLLM
does, so that clients sending newer fields keep working. What reaches these models has passed
body.py: bounded in size, valid UTF-8 JSON, no lone surrogate in any string.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from scheduler_svc.core.errors import InvalidRequestError

# What an int32 field of the gRPC message holds; larger values are a 400 here, not a 500 there.
Int32 = Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
Uint64 = Annotated[StrictInt, Field(ge=0, le=(1 << 64) - 1)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: StrictBool = False  # every chunk carries the usage so far


class SamplingFields(_Body):
    """What completions and chat completions share: OpenAI's fields, then vLLM's extras."""

    model: str | None = Field(None, description="a name from /v1/models; default: the first")
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Uint64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> "
                                                "bias added to its logit")
    user: str | None = Field(None, description="accepted and ignored")
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    allowed_token_ids: list[Int32] | None = None
    bad_words: list[str] | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    truncate_prompt_tokens: Int32 | None = None


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int32] | list[list[Int32]] = Field(
        description="a string, a list of strings, token ids, or a list of token id lists")
    echo: StrictBool = False
    logprobs: Int32 | None = Field(None, description="top-n logprobs per token (0 = the token's "
                                 "own); with echo, the prompt's too")
    suffix: str | None = None  # refused when set: no model here fills in the middle
    best_of: Int32 | None = None  # accepted only as n (no server-side ranking)


class TextPart(_Body):
    type: str = Field(description="only 'text' parts are supported")
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str = Field(description="system, developer, user, assistant or tool")
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = Field(None, description="wins over max_tokens")
    logprobs: StrictBool = False
    top_logprobs: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call "
                                                   "(under auto the reply is constrained to "
                                                   "end with its first call)")


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[Int32] | list[list[Int32]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = None
    user: str | None = None


class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str | None = None  # when set, the path it was loaded from


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int32]


# Prompts (or inputs) one request may hold, OpenAI's own limit on an embeddings input array: each
# is admitted as a request of its own, so 10,000 of them would hold a connection for minutes.
MAX_BATCH = 2048


def as_batch(value: Any, field: str) -> list[Any]:
    """A prompt or input field as a list of items: one string or token id list is a batch of
    one; an empty list, or one of more than MAX_BATCH items, is refused."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(field, "nothing given (an empty list)")
    if isinstance(value[0], int):
        return [value]
    if len(value) > MAX_BATCH:
        raise InvalidRequestError(field, f"{len(value)} items; at most {MAX_BATCH} per request")
    return list(value)


SamplingFields.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
