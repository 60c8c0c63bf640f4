"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, assistant
`tool_calls` and `tool` messages fed back, `tool_calls` in responses (streamed as OpenAI streams
them: a first delta with the call's id and name, then argument fragments).

- `auto`: the model decides; its own format is parsed (tool_parsers.py).
- `required` / a named function: enforced with the structured-output engine, as vLLM does: the
  output is constrained to a JSON array of {"name", "arguments"} (required) or to the named
  function's arguments object, so the arguments always validate against the function's schema.
- `none`: no tools in the prompt, plain content.

A chat template that takes `tools` (Llama 3.1+, Qwen2) gets them and the messages' tool calls
as its own variables; one that does not (SmolLM2's) gets the tools in a system message and
earlier calls written in the parser's format.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.server.generation import ChatMessage, GenerationRequest
from pagedinfer.engine.server.tool_parsers import ParsedCall, ToolParser
from pagedinfer.engine.structured.spec import StructuredOutput

_EXTRAS = ConfigDict(extra="allow")  # extras: request_fields.check_fields


class FunctionDef(BaseModel):
    model_config = _EXTRAS
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None  # (given to the model with the rest of the definition)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _EXTRAS
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _EXTRAS
    name: str


class NamedToolChoice(BaseModel):
    model_config = _EXTRAS
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = _EXTRAS
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = _EXTRAS
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolMessageFields(BaseModel):
    """Mixin of chat messages: an assistant's calls, a tool result's call id."""

    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def tool_call_dicts(self) -> tuple[dict, ...] | None:
        """The calls as chat templates read them (arguments as an object where they parse)."""
        if not self.tool_calls:
            return None
        out = []
        for call in self.tool_calls:
            try:
                args: Any = json.loads(call.function.arguments)
            except ValueError:
                args = call.function.arguments
            out.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": args},
                }
            )
        return tuple(out)


class ToolRequestFields(BaseModel):
    """Mixin of the chat request."""

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


@dataclasses.dataclass
class ToolCalling:
    """One request's tool-calling plan: prompt, constraint, and how outputs become calls."""

    tools: list[ToolDef]
    choice: str  # "none" | "auto" | "required" | "function"
    function: FunctionDef | None  # the named function
    is_parallel: bool
    parser: ToolParser

    @classmethod
    def of(cls, body: ToolRequestFields, parser: ToolParser) -> ToolCalling | None:
        tools = body.tools or []
        choice = body.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: function names must be unique")
        function = None
        if isinstance(choice, NamedToolChoice):
            function = next((t.function for t in tools if t.function.name == choice.function.name), None)
            if function is None:
                raise InvalidRequestError(f"tool_choice: no tool named {choice.function.name!r} in tools")
            choice = "function"
        parallel = body.parallel_tool_calls is not False
        return cls(tools, choice or "auto", function, parallel, parser)

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def apply(self, gen: GenerationRequest, chat_template: str | None) -> GenerationRequest:
        """The engine request with the tools in its prompt and, when forced, its constraint."""
        params = gen.sampling_params
        if self.is_forced:
            if params.structured_output is not None:
                raise InvalidRequestError(
                    "tool_choice required or a named function cannot be combined with response_format"
                )
            params = dataclasses.replace(params, structured_output=self._constraint())
        native = "tools" in (chat_template or "")
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools) if self.choice != "none" else ()
        messages = gen.prompt.messages or ()
        if native:
            prompt = dataclasses.replace(gen.prompt, tools=tools or None)
        else:
            messages = tuple(self._as_text(m) for m in messages)
            if tools:
                messages = _with_system(messages, self.parser.system_prompt(list(tools)))
            prompt = dataclasses.replace(gen.prompt, messages=messages)
        return dataclasses.replace(gen, prompt=prompt, sampling_params=params)

    def _as_text(self, m: ChatMessage) -> ChatMessage:
        """A message for a template without tool support: calls written in the parser's format."""
        if not m.tool_calls:
            return dataclasses.replace(m, tool_call_id=None)
        calls = [
            ParsedCall(c["function"]["name"], _args_text(c["function"]["arguments"])) for c in m.tool_calls
        ]
        content = "\n".join(x for x in (m.content, self.parser.format_calls(calls)) if x)
        return dataclasses.replace(m, content=content, tool_calls=None)

    def _constraint(self) -> StructuredOutput:
        if self.function is not None:
            schema = self.function.parameters or {"type": "object"}
            return StructuredOutput.json_schema(
                schema, bool(self.function.strict), "tools.function.parameters"
            )
        variants = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
        if not self.is_parallel:
            schema["maxItems"] = 1
        return StructuredOutput.json_schema(schema, False, "tools.function.parameters")

    def calls_of(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a complete output."""
        if self.choice == "none":
            return text, []
        if self.function is not None:
            loaded = _load(text)
            if not isinstance(loaded, dict):
                return text, []  # cut short (max_tokens): left as content
            return None, [ParsedCall(self.function.name, json.dumps(loaded, ensure_ascii=False))]
        if self.choice == "required":
            loaded = _load(text)
            if not isinstance(loaded, list):
                return text, []
            return None, [
                ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in loaded
            ]
        content, calls = self.parser.parse(text)
        known = {t.function.name for t in self.tools}
        if any(c.name not in known for c in calls):
            return text, []  # a call of a function the request does not offer: plain text
        return content, calls if self.is_parallel else calls[:1]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The response's assistant message and finish reason for a complete output."""
        content, calls = self.calls_of(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [call_dict(c) for c in calls]}
        # OpenAI ends a forced named call with "stop", a call the model chose with "tool_calls"
        if finish_reason == "stop" and self.function is None:
            finish_reason = "tool_calls"
        return message, finish_reason


def call_dict(call: ParsedCall, call_id: str | None = None) -> dict:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _with_system(messages: tuple[ChatMessage, ...], text: str) -> tuple[ChatMessage, ...]:
    if messages and messages[0].role == "system":
        first = dataclasses.replace(messages[0], content=f"{messages[0].content}\n\n{text}")
        return (first, *messages[1:])
    return (ChatMessage(role="system", content=text), *messages)


def _args_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
