"""What a request's output must match: a JSON schema, any JSON object, a regex, one of several
strings, or an EBNF / Lark grammar. A frozen value carried in SamplingParams (no torch, no
grammar engine here: engine.core reads it); compiler.py turns it into token masks."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from pagedinfer.engine.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 100_000


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json"  # `text`: the schema as JSON
    JSON_OBJECT = "json_object"  # any JSON object (`text` empty)
    REGEX = "regex"
    CHOICE = "choice"  # `text`: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # EBNF (GBNF, `root ::= ...`) or Lark (`start: ...`)


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint. `strict` (JSON schemas): objects take no properties beyond
    those the schema lists, as OpenAI's strict mode; otherwise the schema's own rules.
    `param`: the request field it came from, named in errors (not part of the identity)."""

    kind: GrammarKind
    text: str = ""
    strict: bool = False
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"{self.param}: longer than {MAX_GRAMMAR_CHARS} characters")
        if self.kind is GrammarKind.JSON_OBJECT:
            return
        if not self.text.strip():
            raise InvalidRequestError(f"{self.param}: empty {self.kind.value}")
        if self.kind is GrammarKind.JSON_SCHEMA:
            schema = _load(self.text, self.param)
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(f"{self.param}: a JSON schema must be an object")
        if self.kind is GrammarKind.CHOICE:
            choices = _load(self.text, self.param)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of strings")

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind.value, self.text, self.strict)

    @classmethod
    def json_schema(cls, schema: object, strict: bool = False, param: str = "structured_outputs.json"):
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(GrammarKind.JSON_SCHEMA, text, strict, param)

    @classmethod
    def choice(cls, choices: object, param: str = "structured_outputs.choice") -> StructuredOutput:
        if not isinstance(choices, list):
            raise InvalidRequestError(f"{param}: choice must be a non-empty list of strings")
        return cls(GrammarKind.CHOICE, json.dumps(choices), param=param)


def _load(text: str, param: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"{param}: not valid JSON: {e}") from e
