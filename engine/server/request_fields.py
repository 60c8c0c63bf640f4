"""Honest by construction: every request field is read, or named in exactly one list here.

The request models (openai_protocol.py, ws_gateway.py; the gRPC messages in proto/) declare only
fields that the code building the engine request reads. Any other field a client sends lands in
the model's extras and is sorted here:

- `NO_EFFECT_FIELDS`: OpenAI fields that change nothing in the output: accepted, not read.
- `REFUSED_UNTIL_IMPLEMENTED`: fields that change the output and are not implemented yet
  (structured outputs and tool calling, issue 46 part B): 400 naming the field. Implementing one
  means declaring it on the models and taking it out of this list.
- `UNSUPPORTED_FIELDS`: fields this server will not implement: 400 naming the field and why.
- `CHAT_ONLY_FIELDS`: declared on the chat request; sent to another endpoint, a 400 saying so.
- anything else is unknown: 400 naming the field, unless the server runs with
  `--allow-unknown-fields`, which accepts and logs it.

tests/engine/server/test_request_fields.py walks the models and fails on a declared field that
no code reads, or on a name that is both declared and listed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from pydantic import BaseModel

from pagedinfer.engine.errors import InvalidRequestError

logger = logging.getLogger("pagedinfer.server")

NO_EFFECT_FIELDS = frozenset(
    {
        "user",  # an end-user id for abuse monitoring
        "metadata",  # stored-completion tags
        "store",  # whether OpenAI stores the completion
        "service_tier",  # a billing / latency tier
        "safety_identifier",  # user's replacement
        "prompt_cache_key",  # a routing hint for OpenAI's prompt cache
    }
)

REFUSED_UNTIL_IMPLEMENTED = frozenset(
    {
        # structured outputs (response_format, structured_outputs, guided_json / regex / choice /
        # grammar are implemented: server/structured_fields.py)
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        # tool calling: tools, tool_choice, parallel_tool_calls and the messages' tool_calls /
        # tool_call_id are implemented (server/tool_calls.py); OpenAI's deprecated spellings are not
        "functions",
        "function_call",
    }
)

# Declared on the chat request only (server/tool_calls.py): elsewhere (/v1/completions, the
# WebSocket's generate) they would land in the extras, and --allow-unknown-fields must not make
# them accepted-and-ignored there.
CHAT_ONLY_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})

UNSUPPORTED_FIELDS: dict[str, str] = {
    "suffix": "the served models have no fill-in-the-middle mode",
    "audio": "the served models produce text only",
    "modalities": "the served models produce text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "this server has no web search",
    "reasoning_effort": "the served models have no reasoning mode",
    "verbosity": "the served models have no verbosity setting",
}


def _extras(model: BaseModel, path: str) -> Iterator[tuple[str, str]]:
    """(name, dotted path) of every extra field in `model` and the models nested in it."""
    for name in model.model_extra or {}:
        yield name, f"{path}{name}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}{name}[{i}]." if isinstance(value, list) else f"{path}{name}."
                yield from _extras(item, where)


def check_fields(model: BaseModel, allow_unknown: bool) -> None:
    """Raise InvalidRequestError naming the first field of `model` that is refused: one not
    implemented yet, one never supported, or one unknown (unless `allow_unknown`: logged)."""
    unknown = []
    for name, where in _extras(model, ""):
        if name in NO_EFFECT_FIELDS:
            continue
        if name in CHAT_ONLY_FIELDS:
            raise InvalidRequestError(f"{where}: tool calling is for /v1/chat/completions", param=where)
        if name in REFUSED_UNTIL_IMPLEMENTED:
            raise InvalidRequestError(f"{where}: this field is not supported yet", param=where)
        if name in UNSUPPORTED_FIELDS:
            raise InvalidRequestError(f"{where}: not supported ({UNSUPPORTED_FIELDS[name]})", param=where)
        if not allow_unknown:
            raise InvalidRequestError(f"{where}: unknown field", param=where)
        unknown.append(where)
    if unknown:
        logger.info("accepted unknown request fields (--allow-unknown-fields): %s", ", ".join(unknown))
