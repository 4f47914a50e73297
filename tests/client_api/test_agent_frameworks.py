"""Agent frameworks against the shared session server: the OpenAI Agents SDK runs an agent with
a Python function tool through chat completions and through the Responses API, and LangChain's
ChatOpenAI.bind_tools gets tool_calls back.

The small default model does not call a tool on its own on these prompts, so the first turn
sends tool_choice "required" (the agent SDK resets it to auto once the tool ran, and the agent
then answers in text).
"""

from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

from tests.client_api.test_openai_sdk import MODEL

pytestmark = pytest.mark.slow
SETTINGS = ModelSettings(tool_choice="required", max_tokens=24, temperature=0)


def _run_agent(server, model_class) -> tuple[list[str], str]:
    """(the cities the tool was called with, the agent's final output)."""
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    async def main() -> str:
        set_tracing_disabled(True)
        async with AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=300) as client:
            agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                          model=model_class(model=MODEL, openai_client=client),
                          model_settings=SETTINGS)
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
            return str(result.final_output)

    output = asyncio.run(asyncio.wait_for(main(), 600))
    return cities, output


@pytest.mark.parametrize("model_class", [OpenAIChatCompletionsModel, OpenAIResponsesModel])
def test_an_agent_calls_its_tool_and_finishes(server, model_class):
    cities, output = _run_agent(server, model_class)
    assert len(cities) == 1 and cities[0].strip(), cities  # called once, with a city
    assert output.strip()


def test_langchain_bind_tools_returns_tool_calls(server):
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="unused", temperature=0,
                     max_tokens=24, max_retries=0, timeout=300)
    reply = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")
