"""The request fields that ask for structured outputs, in OpenAI's and vLLM's spellings:

- OpenAI `response_format`: {"type": "text"}, {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (EBNF or
  Lark), json_object;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may constrain a request; each becomes one `StructuredOutput` whose `param`
names the field, so an invalid schema, regex or grammar is a 400 naming it (compiled by the
engine: engine/structured/compiler.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.structured.spec import GrammarKind, StructuredOutput

_EXTRAS = ConfigDict(extra="allow", populate_by_name=True)  # extras: request_fields.check_fields


class JsonSchemaFormat(BaseModel):
    model_config = _EXTRAS
    name: str = Field(default="response", max_length=64)
    description: str | None = None  # (documentation for the model; OpenAI does not prompt with it either)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _EXTRAS
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(GrammarKind.JSON_OBJECT, param="response_format")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema: required for type json_schema")
        return StructuredOutput.json_schema(
            self.json_schema.schema_, bool(self.json_schema.strict), "response_format.json_schema.schema"
        )


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object."""

    model_config = _EXTRAS
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_structured(self) -> StructuredOutput | None:
        given = [
            s
            for s in (
                None
                if self.json_ is None
                else StructuredOutput.json_schema(self.json_, param="structured_outputs.json"),
                _text(GrammarKind.REGEX, self.regex, "structured_outputs.regex"),
                None
                if self.choice is None
                else StructuredOutput.choice(self.choice, "structured_outputs.choice"),
                _text(GrammarKind.GRAMMAR, self.grammar, "structured_outputs.grammar"),
                StructuredOutput(GrammarKind.JSON_OBJECT, param="structured_outputs.json_object")
                if self.json_object
                else None,
            )
            if s is not None
        ]
        if len(given) > 1:
            raise InvalidRequestError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, json_object"
            )
        return given[0] if given else None


class StructuredOutputFields(BaseModel):
    """Mixin of the request models (chat, completions, WebSocket)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The request's one constraint, or None; 400 when several fields ask for one."""
        candidates = {
            "response_format": self.response_format.to_structured() if self.response_format else None,
            "structured_outputs": self.structured_outputs.to_structured()
            if self.structured_outputs
            else None,
            "guided_json": None
            if self.guided_json is None
            else StructuredOutput.json_schema(self.guided_json, param="guided_json"),
            "guided_regex": _text(GrammarKind.REGEX, self.guided_regex, "guided_regex"),
            "guided_choice": None
            if self.guided_choice is None
            else StructuredOutput.choice(self.guided_choice, "guided_choice"),
            "guided_grammar": _text(GrammarKind.GRAMMAR, self.guided_grammar, "guided_grammar"),
        }
        given = {name: s for name, s in candidates.items() if s is not None}
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one structured-output field, got {', '.join(given)}")
        return next(iter(given.values()), None)


def _text(kind: GrammarKind, text: str | None, param: str) -> StructuredOutput | None:
    return None if text is None else StructuredOutput(kind, text, param=param)


def structured_from_pb(msg: Any) -> StructuredOutput | None:
    """The gRPC `StructuredOutput` message (proto/pagedinfer/v1/inference.proto) as the engine's."""
    which = msg.WhichOneof("kind")
    param = f"sampling.structured_output.{which}"
    if which is None:
        return None
    if which == "json_schema":
        return StructuredOutput.json_schema(msg.json_schema, msg.strict, param)
    if which == "json_object":
        return StructuredOutput(GrammarKind.JSON_OBJECT, param=param) if msg.json_object else None
    if which == "choice":
        return StructuredOutput.choice(list(msg.choice.values), param)
    kind = GrammarKind.REGEX if which == "regex" else GrammarKind.GRAMMAR
    return StructuredOutput(kind, getattr(msg, which), param=param)
