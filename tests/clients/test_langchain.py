"""LangChain's ChatOpenAI (`langchain-openai`) against the router's OpenAI door over the bundled
model, greedy: structured output into a pydantic model (both of its methods) and a forced tool call
round trip. The door enforces the formats (structured outputs), so a 135M model still gets them right."""

from __future__ import annotations

import functools
import operator

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.clients.conftest import Door

pytestmark = pytest.mark.timeout(300)


class City(BaseModel):
    """A city and the country it is in."""

    # additionalProperties: false, so the enforced schema ends the object after these three keys
    # (a 135M model otherwise keeps inventing keys until max_tokens).
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="the city's name", max_length=40)
    country: str = Field(description="the country the city is in", max_length=40)
    population_millions: int = Field(description="its population, in millions", ge=0, le=100)


@tool
def get_weather(city: str, unit: str) -> str:
    """The current weather in a city, in "celsius" or "fahrenheit"."""
    return f"Sunny, 21 degrees {unit} in {city}."


def chat(door: Door, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(model=door.model, base_url=door.base_url, api_key="unused", temperature=0,
                      max_tokens=max_tokens, max_retries=0, timeout=120)


def ask(model: Runnable, messages: list[BaseMessage], stream: bool) -> AIMessage:
    """One reply, whole (`invoke`) or as LangChain adds up a stream's chunks (tool call deltas too)."""
    if not stream:
        return model.invoke(messages)
    chunks = list(model.stream(messages))
    assert len(chunks) > 1
    return functools.reduce(operator.add, chunks)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_model(bundled_door: Door, method: str) -> None:
    structured = chat(bundled_door, 80).with_structured_output(City, method=method, include_raw=True)
    result = structured.invoke([HumanMessage("Name a big city in France, as JSON.")])
    assert result["parsing_error"] is None, result
    city = result["parsed"]
    assert isinstance(city, City), result
    assert city.name.strip() and city.country.strip()
    raw = result["raw"]
    assert isinstance(raw, AIMessage)
    if method == "function_calling":
        assert [call["name"] for call in raw.tool_calls] == ["City"]
        assert raw.response_metadata["finish_reason"] == "tool_calls"
    else:
        assert raw.response_metadata["finish_reason"] == "stop"


# langchain-openai dumps the SDK's streamed ParsedChatCompletion (typed `parsed: None`) holding the
# parsed City, and pydantic warns about that type: theirs, not the door's.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_streams_to_the_same_instance(bundled_door: Door, method: str) -> None:
    structured = chat(bundled_door, 80).with_structured_output(City, method=method)
    messages = [HumanMessage("Name a big city in France, as JSON.")]
    streamed = list(structured.stream(messages))
    assert streamed and isinstance(streamed[-1], City)
    assert streamed[-1] == structured.invoke(messages)  # greedy: the same object either way


@pytest.mark.parametrize("stream", [False, True])
def test_bind_tools_round_trip(bundled_door: Door, stream: bool) -> None:
    model = chat(bundled_door, 60).bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris, in celsius?")
    first = ask(model, [question], stream)
    assert isinstance(first, AIMessage)
    assert first.response_metadata["finish_reason"] == "tool_calls"
    assert not first.invalid_tool_calls
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0]
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city", "unit"}
    assert all(isinstance(value, str) for value in call["args"].values())
    assert call["id"]

    result = get_weather.invoke(call)  # a ToolMessage answering that call id
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    # Back to the model with the tool's answer, tools still bound (tool_choice "auto": SmolLM2's
    # template teaches no call syntax, so it answers in text), as an agent loop does.
    answer = ask(chat(bundled_door, 30).bind_tools([get_weather]), [question, first, result], stream)
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] == "stop"
    assert not answer.tool_calls and not answer.invalid_tool_calls
    assert isinstance(answer.content, str)
    assert "21" in answer.content  # greedy: it reads the tool's answer back ("... 21 degrees Celsius.")
