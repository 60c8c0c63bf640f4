"""The tool-call formats (hermes, llama3_json, smollm2), the parser chosen from a chat template,
and the streamed tool-call deltas in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput
from pagedinfer.engine.server.openai_protocol import ChatCompletionRequest
from pagedinfer.engine.server.tool_calls import ToolCalling
from pagedinfer.engine.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    SmolLM2Parser,
    choose_parser,
)
from pagedinfer.engine.server.tool_stream import ToolStreamRenderer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            HermesParser(),
            'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "Sure.",
            [("f", {"a": 1})],
        ),
        (
            HermesParser(),
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>',
            None,
            [("f", {}), ("g", {"b": "x"})],
        ),
        (HermesParser(), "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (HermesParser(), "just text", "just text", []),
        (Llama3JsonParser(), '{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        (
            Llama3JsonParser(),
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": [1]}}',
            None,
            [("f", {}), ("g", {"x": [1]})],
        ),
        (Llama3JsonParser(), "The answer is {1}", "The answer is {1}", []),
        (Llama3JsonParser(), '{"not": "a call"}', '{"not": "a call"}', []),
        (
            SmolLM2Parser(),
            '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>',
            None,
            [("f", {"a": 1}), ("g", {})],
        ),
        (
            SmolLM2Parser(),
            'ok <tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>',
            "ok",
            [("f", {"a": 2})],
        ),
        (SmolLM2Parser(), "no calls", "no calls", []),
    ],
)
def test_parsers(parser, text, content, calls) -> None:
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), SmolLM2Parser()])
def test_format_calls_round_trips(parser) -> None:
    calls = [ParsedCall("f", '{"a": 1}'), ParsedCall("g", "{}")]
    content, parsed = parser.parse(parser.format_calls(calls))
    assert content is None and parsed == calls
    assert "<tools>" in parser.system_prompt([WEATHER])


def test_choose_parser_from_the_template_or_the_flag() -> None:
    assert choose_parser("{{ '<|python_tag|>' }}{% if tools %}{% endif %}").name == "llama3_json"
    assert choose_parser("{% if tools %}<tool_call>{% endif %}<|im_start|>").name == "hermes"
    assert choose_parser("<|im_start|>{{ m['content'] }}").name == "smollm2"
    assert choose_parser(None, "hermes").name == "hermes"


def _calling(**body) -> ToolCalling:
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], **body
    )
    return ToolCalling.of(request, SmolLM2Parser())


def _events(
    renderer: ToolStreamRenderer, pieces: list[str], reason: FinishReason = FinishReason.STOP
) -> list[dict]:
    text = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionDelta(0, piece, finish_reason=reason if last else None)
        text.append(renderer.render(RequestOutput("r", [delta], finished=last)))
    chunks = [line[6:] for line in "".join(text).split("\n\n") if line.startswith("data: {")]
    return [json.loads(c)["choices"][0] for c in chunks]


def test_stream_named_function_first_delta_then_argument_fragments() -> None:
    calling = _calling(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choices = _events(ToolStreamRenderer("r", 0, "m", False, calling), ['{"city"', ': "Paris"', "}"])
    first = choices[0]["delta"]
    assert first["role"] == "assistant" and first["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert first["tool_calls"][0]["id"].startswith("call_") and first["tool_calls"][0]["index"] == 0
    fragments = [c["delta"]["tool_calls"][0]["function"]["arguments"] for c in choices[1:-1]]
    assert "".join(fragments) == '{"city": "Paris"}'
    assert choices[-1]["finish_reason"] == "stop"


def test_stream_auto_content_then_held_calls() -> None:
    calling = _calling(tool_choice="auto")
    pieces = [
        "Let me check. <tool",
        '_call>[{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}]</tool_call>',
    ]
    choices = _events(ToolStreamRenderer("r", 0, "m", False, calling), pieces)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == "Let me check. "
    calls = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert choices[-1]["finish_reason"] == "tool_calls"
    # no call after all: the held text goes out as content
    choices = _events(ToolStreamRenderer("r", 0, "m", False, calling), ["a <tool_c", "x"])
    assert "".join(c["delta"].get("content") or "" for c in choices) == "a <tool_cx"
    assert choices[-1]["finish_reason"] == "stop"


def test_required_parallel_and_messages() -> None:
    calling = _calling(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(calling._constraint().text)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    message, reason = calling.message('[{"name": "get_time", "arguments": {}}]', "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    auto = _calling(parallel_tool_calls=False)
    two = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}]</tool_call>'
    assert len(auto.message(two, "stop")[0]["tool_calls"]) == 1
    unknown = '<tool_call>[{"name": "rm_rf", "arguments": {}}]</tool_call>'
    assert auto.message(unknown, "stop") == ({"role": "assistant", "content": unknown}, "stop")
