"""The body of POST /v1/responses, as pydantic models (they make /openapi.json). Strict where
OpenAI is, and unknown fields ignored, as protocol.py does for the chat API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool

from scheduler_svc.service.openai.protocol import Int32, _Body


class ContentPart(_Body):
    type: Literal["input_text", "output_text", "text"] = Field(
        description="only text parts are supported")
    text: str


class InputItem(_Body):
    """A message ({role, content}), a function call the model made earlier, or its output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | None = None  # function_call_output
    id: str | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = Field(None, description="a name from /v1/models; default: the first")
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="a system message before the input "
                                     "(not carried over by previous_response_id)")
    previous_response_id: str | None = None
    store: StrictBool = True
    stream: StrictBool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


ResponsesRequest.model_rebuild()
