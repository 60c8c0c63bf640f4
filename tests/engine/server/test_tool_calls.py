"""Tool calling against a real server (SmolLM2, whose template has no tool support: the tools go
in a system message, calls are written in SmolLM2's `<tool_call>[...]</tool_call>` format)
through the openai SDK and LangChain: required and named calls (enforced by the grammar: their
arguments always validate against the function's schema), auto, none, parallel_tool_calls,
streamed tool-call deltas, tool results fed back, `bind_tools` and `with_structured_output`."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(600)
SERVER_ARGS = ("--max-num-seqs", "16")

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(message) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return message.tool_calls


def test_required_and_named_calls_validate_greedy_and_sampled(client, model) -> None:
    def required(temperature: float):
        return client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            # sampled, SmolLM2 may chain many calls: one call keeps the output inside max_tokens
            parallel_tool_calls=temperature == 0.0,
            max_tokens=64,
            temperature=temperature,
            n=2,
            seed=1,
        )

    def named(temperature: float):
        return client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=32,
            temperature=temperature,
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one batch on the server
        futures = [pool.submit(f, t) for f in (required, named) for t in (0.0, 1.0)]
        outs = [f.result() for f in futures]
    for out in outs[:2]:
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message)
    for out in outs[2:]:
        (call,) = _check_calls(out.choices[0].message)
        assert call.function.name == "add" and out.choices[0].finish_reason == "stop"


def test_parallel_false_gives_one_call_and_none_gives_text(client, model) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
    )
    assert len(_check_calls(out.choices[0].message)) == 1
    none = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_auto_answers_with_content_or_valid_calls(client, model) -> None:
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=32, temperature=0)
    message = out.choices[0].message
    if message.tool_calls:  # the model chose to call: its own format, parsed
        assert out.choices[0].finish_reason == "tool_calls"
        assert {c.function.name for c in message.tool_calls} <= set(PARAMS)
    else:
        assert message.content


def test_streamed_calls_as_openai_streams_them(client, model) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        stream = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:  # the first delta of a call: id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
        assert calls and finish == ("tool_calls" if tool_choice == "required" else "stop")
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_tool_results_fed_back_through_the_template(client, model) -> None:
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
    )
    (call,) = _check_calls(first.choices[0].message)
    result = "It is 21 degrees and sunny in Paris."
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=24, temperature=0
    )
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    # the call and the result are in the prompt: it grew by at least their tokens
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_invalid_tool_requests_are_400(client, model) -> None:
    cases = [
        {"tool_choice": "required"},  # no tools
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"tools": TOOLS, "functions": [{"name": "x"}]},
    ]
    for body in cases:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class City(BaseModel):
    """A city."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


def test_langchain_bind_tools_and_structured_output(server, model) -> None:
    llm = ChatOpenAI(
        base_url=f"{server.http}/v1",
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=40,
        max_retries=0,
    )
    forced = llm.bind_tools([add], tool_choice="add")
    msg = forced.invoke([HumanMessage("What is 3 plus 4?")])
    (call,) = msg.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    answer = add.invoke(call["args"])
    follow = llm.bind_tools([add]).invoke(
        [HumanMessage("What is 3 plus 4?"), msg, ToolMessage(str(answer), tool_call_id=call["id"])]
    )
    assert follow.content or follow.tool_calls
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Name a big city.")
        assert isinstance(city, City) and city.name
