"""The models' own tool-call formats: one parser per format, chosen from the chat template
(overridable with `--tool-call-parser`).

- `hermes` (Qwen2 / Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`;
- `smollm2` (SmolLM2): `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.

A parser finds the calls in a complete output (`parse`), says where a call may start in a
streamed one (`start_marker`), writes calls back into an assistant message for a template that
has no tool support (`format_calls`), and words the tool list for such a template's system
prompt (`system_prompt`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    name = ""
    start_marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content outside the calls or None, the calls) of a complete output."""
        raise NotImplementedError

    def format_calls(self, calls: list[ParsedCall]) -> str:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        functions = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        example = self.format_calls([ParsedCall("func_name", '{"arg": "value"}')])
        return (
            "You have access to the following functions. To call one or more of them, answer with "
            f"exactly this format and nothing else: {example}\n<tools>{functions}</tools>"
        )


def _call_of(obj: object, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _load(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


# A <tool_call> block (Hermes and SmolLM2 write calls in them); an unclosed one runs to the end.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for match in _TOOL_CALL_BLOCK.finditer(text):
            call = _call_of(_load(match.group(1)), "arguments")
            if call is None:
                return _content(text), []  # not a well-formed call: the text stays content
            calls.append(call)
        if not calls:
            return _content(text), []
        return _content(text[: text.index(self.start_marker)]), calls

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
            for c in calls
        )


class SmolLM2Parser(ToolParser):
    name = "smollm2"
    start_marker = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        match = _TOOL_CALL_BLOCK.search(text)
        if match is None:
            return _content(text), []
        loaded = _load(match.group(1))
        items = loaded if isinstance(loaded, list) else [loaded]
        calls = [_call_of(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return _content(text), []
        return _content(text[: match.start()]), calls

    def format_calls(self, calls: list[ParsedCall]) -> str:
        items = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"<tool_call>[{items}]</tool_call>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG) :].strip()
        if not body.startswith("{"):
            return _content(text), []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return _content(text), []
            call = _call_of(obj, "parameters")
            if call is None:
                return _content(text), []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, SmolLM2Parser)}


def choose_parser(chat_template: str | None, override: str | None = None) -> ToolParser:
    """The parser named by `override` (`--tool-call-parser`), else the chat template's format:
    `<tool_call>` with Qwen's `tools` section (hermes), Llama 3's `<|python_tag|>` / ipython
    (llama3_json), otherwise SmolLM2's."""
    if override and override != "auto":
        return PARSERS[override]()
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template or "<|eot_id|>" in template:
        return Llama3JsonParser()
    if "<tool_call>" in template and "tools" in template:
        return HermesParser()
    return SmolLM2Parser()
