"""Structured outputs against a real server (SmolLM2) through the openai SDK, WebSocket and gRPC:
33 JSON schemas (nested objects, arrays, enums, required, patterns, numbers with bounds),
greedy and sampled, sent concurrently to one server: every output parses and validates
(jsonschema); regex and choice likewise; an invalid schema, regex or grammar is a 400 naming it.
Strings are bounded (maxLength, pattern, enum) and arrays have maxItems so a complete document
fits the small max_tokens."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pytest
import websockets

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)
SERVER_ARGS = ("--max-num-seqs", "32")
MAX_TOKENS = 80
SYSTEM = "You answer with JSON only."

NAME = {"type": "string", "maxLength": 12}
SHORT = {"type": "string", "maxLength": 8}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: dict[str, dict] = {
    "person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "city": obj({"city": NAME, "country": NAME}),
    "bool_flag": obj({"ok": {"type": "boolean"}}),
    "enum_color": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_int": obj({"level": {"enum": [1, 2, 3]}}),
    "const": obj({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -5, "maximum": 5}}),
    "int_bounds": obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
    "exclusive_bounds": obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "number_bounds": obj({"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
    "pattern_zip": obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "pattern_code": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "pattern_date": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "array_ints": obj(
        {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}}
    ),
    "array_min_items": obj(
        {"xs": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 3}}
    ),
    "array_of_objects": obj(
        {
            "items": {
                "type": "array",
                "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9}}),
                "maxItems": 2,
            }
        }
    ),
    "nested": obj(
        {"user": obj({"name": NAME, "address": obj({"zip": {"type": "string", "pattern": "^[0-9]{4}$"}})})}
    ),
    "nested_three": obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    "optional_fields": obj({"name": NAME, "nick": SHORT}, required=["name"]),
    "nullable": obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}}),
    "any_of": obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}),
    "one_level_ref": {
        "$defs": {"pt": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}})},
        **obj({"p": {"$ref": "#/$defs/pt"}}),
    },
    "top_array": {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 1, "maxItems": 3},
    "top_enum": {"enum": ["alpha", "beta", "gamma"]},
    "top_integer": {"type": "integer", "minimum": 100, "maximum": 200},
    "top_string_pattern": {"type": "string", "pattern": "^[a-z]{3,6}$"},
    "tuple_prefix": obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
                "items": False,
            }
        }
    ),
    "string_min_length": obj({"s": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "mixed_types": obj(
        {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "tag": {"enum": ["new", "old"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        }
    ),
    "event": obj(
        {
            "title": NAME,
            "when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "guests": {"type": "array", "items": SHORT, "maxItems": 2},
        }
    ),
    "order": obj(
        {
            "sku": {"type": "string", "pattern": "^SKU[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 5},
            "gift": {"type": "boolean"},
        }
    ),
    "weather": obj(
        {
            "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
            "sky": {"enum": ["sun", "rain", "snow"]},
        }
    ),
    "empty_object_allowed": obj({}, required=[]),
    "matrix": obj(
        {
            "rows": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1},
                    "maxItems": 2,
                },
                "maxItems": 2,
            }
        }
    ),
}


def _response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _chat(client: openai.AsyncOpenAI, model: str, name: str, schema: dict, **kwargs):
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Give me a {name}."}],
        response_format=_response_format(name, schema),
        max_tokens=MAX_TOKENS,
        **kwargs,
    )


@pytest.fixture  # (function scope: each async test has its own event loop)
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=300)


def _check_all(results: list, schemas: list[dict]) -> None:
    failures = []
    for (name, schema), response in zip(schemas, results, strict=True):
        for choice in response.choices:
            text = choice.message.content
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append(f"{name} ({choice.finish_reason}): {text!r}: {e}")
    assert not failures, "\n".join(failures)


async def test_33_schemas_greedy_and_sampled_all_validate(aclient, model, server) -> None:
    """Every schema twice: greedy, and sampled (temperature 1, n=2) - 99 documents at once."""
    assert len(SCHEMAS) >= 30
    items = list(SCHEMAS.items())
    greedy = [_chat(aclient, model, name, schema, temperature=0) for name, schema in items]
    sampled = [
        _chat(aclient, model, name, schema, temperature=1.0, n=2, seed=i)
        for i, (name, schema) in enumerate(items)
    ]
    results = await asyncio.gather(*greedy, *sampled)
    _check_all(results, items + items)
    assert all(c.finish_reason == "stop" for r in results for c in r.choices)
    server.wait_idle()


async def test_json_object_and_completions_endpoint(aclient, model) -> None:
    chat = await aclient.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")
    schema = SCHEMAS["person"]
    completion = await aclient.completions.create(
        model=model,
        prompt="A person as JSON:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": _response_format("person", schema)},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


async def test_regex_and_choice_in_every_spelling(aclient, model) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["positive", "negative", "neutral"]
    bodies = [
        {"structured_outputs": {"regex": regex}},
        {"guided_regex": regex},
        {"structured_outputs": {"choice": choices}},
        {"guided_choice": choices},
    ]
    calls = [
        aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "I love this movie! Sentiment?"}],
            max_tokens=20,
            temperature=t,
            n=n,
            extra_body=body,
        )
        for body in bodies
        for t, n in ((0, 1), (1.0, 3))
    ]
    results = await asyncio.gather(*calls)
    for i, response in enumerate(results):
        body = bodies[i // 2]
        for choice in response.choices:
            text = choice.message.content
            if "regex" in json.dumps(body):
                assert re.fullmatch(regex, text), (body, text)
            else:
                assert text in choices, (body, text)


async def test_guided_json_and_grammar_and_streaming(aclient, model) -> None:
    schema = SCHEMAS["order"]
    stream = await aclient.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "An order as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"guided_json": schema},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), schema)
    ebnf = 'root ::= "(" [0-9] " + " [0-9] ")"'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'
    for body in ({"structured_outputs": {"grammar": ebnf}}, {"guided_grammar": lark}):
        out = await aclient.completions.create(
            model=model, prompt="x", max_tokens=12, temperature=0.8, extra_body=body
        )
        pattern = r"\([0-9] \+ [0-9]\)" if "::=" in json.dumps(body) else r"<[a-z]{1,5}>"
        assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "bogus"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a{3,1}"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_invalid_constraint_is_a_400_naming_it(client, model, body, named) -> None:
    for create in (
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=body
        ),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body=body),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert named in str(err.value), str(err.value)


async def test_websocket_generation_with_a_schema(server) -> None:
    schema = SCHEMAS["weather"]
    async with websockets.connect(server.ws, origin=server.http) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "w",
                    "messages": [{"role": "user", "content": "Weather as JSON."}],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "response_format": _response_format("weather", schema),
                }
            )
        )
        text = ""
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                text += "".join(d["text"] for d in msg["deltas"])
            else:
                assert msg["type"] == "done", msg
                break
    jsonschema.validate(json.loads(text), schema)


def test_grpc_structured_output_and_invalid_argument(server) -> None:
    schema = SCHEMAS["city"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        sampling = pb.SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0,
            structured_output=pb.StructuredOutput(json_schema=json.dumps(schema), strict=True),
        )
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="A city as JSON.")])
        text = "".join(
            d.text
            for r in stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling), timeout=300)
            for d in r.deltas
        )
        jsonschema.validate(json.loads(text), schema)
        choice = pb.SamplingParams(
            max_tokens=8,
            temperature=1.0,
            structured_output=pb.StructuredOutput(choice=pb.Choices(values=["left", "right"])),
        )
        text = "".join(
            d.text
            for r in stub.Generate(pb.GenerateRequest(prompt="Go", sampling=choice), timeout=300)
            for d in r.deltas
        )
        assert text in ("left", "right")
        bad = pb.SamplingParams(max_tokens=4, structured_output=pb.StructuredOutput(regex="(unclosed"))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt="x", sampling=bad), timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured_output.regex" in err.value.details()
