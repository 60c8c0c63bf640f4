"""Offline stand-ins for what the API server does with the CRD: defaulting, schema and CEL checks."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: absent fields with a default get it."""
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: dict[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default(sub, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default(schema["items"], item)


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """openAPIV3Schema violations (Draft 4 semantics: boolean exclusiveMinimum, as OpenAPI v3)."""
    validator = jsonschema.Draft4Validator(schema)
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)
    )


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """Values as the API server types them for CEL (a `number` is a double even if written 1)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = (
            schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        )
        return {k: _typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items") or {}, v) for v in value]
    return value


def cel_violations(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Messages of every x-kubernetes-validations rule that evaluates to false, walking the schema."""
    out: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(_typed(schema, obj))})
        if not bool(result):
            out.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in obj:
                out += cel_violations(sub, obj[name], f"{path}.{name}" if path else name)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_violations(schema["items"], item, f"{path}[{i}]")
    return out


def all_rules(schema: dict[str, Any]) -> list[str]:
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations") or []]
    for sub in (schema.get("properties") or {}).values():
        rules += all_rules(sub)
    if isinstance(schema.get("items"), dict):
        rules += all_rules(schema["items"])
    return rules
