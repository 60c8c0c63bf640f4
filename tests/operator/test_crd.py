"""The CRD: committed file == generated one; every schema bound and CEL rule, valid and invalid.

Each example is checked three ways that must agree: the openAPIV3Schema (jsonschema), the CEL
rules (cel-python, after API-server-style defaulting), and the operator's pydantic models.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from operator_crd_tools import all_rules, apply_defaults, cel_violations, schema_errors
from operator_render_tools import FULL_SPEC

from pagedinfer.operator.crd import CRD_RELPATH, build_crd, render_crd_yaml
from pagedinfer.operator.spec import InferenceEngineSpec

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]


def cr(spec: dict[str, Any], name: str = "engine") -> dict[str, Any]:
    return {
        "apiVersion": "serving.pagedinfer.io/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def verdicts(obj: dict[str, Any]) -> tuple[list[str], list[str], bool]:
    """(schema errors, CEL violations, pydantic accepts) for one CR."""
    errors = schema_errors(SCHEMA, obj)
    defaulted = apply_defaults(SCHEMA, obj)
    cel = cel_violations(SCHEMA, defaulted) if not errors else []
    try:
        InferenceEngineSpec.model_validate(obj["spec"])
        accepted = True
    except pydantic.ValidationError:
        accepted = False
    return errors, cel, accepted


def with_value(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(FULL_SPEC if base is None else base)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return spec


_DELETE = object()


def test_committed_crd_is_generated():
    committed = (ROOT / CRD_RELPATH).read_text()
    assert committed == render_crd_yaml(), "run: python -m pagedinfer.operator.crd --write"
    doc = yaml.safe_load(committed)
    assert doc["spec"]["names"]["shortNames"] == ["ie"]
    version = doc["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for name in ["Ready", "Replicas", "Model", "GPUs", "Tokens/s", "KV %", "Age"]:
        assert name in columns


def test_crd_schema_is_structural():
    """Every node has a type (or is int-or-string / preserve-unknown), no $ref or nullable unions."""

    def walk(node: dict[str, Any], path: str) -> None:
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), path
        if "additionalProperties" in node:
            assert "properties" not in node and isinstance(node["additionalProperties"], dict), path
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(SCHEMA, "")


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"uri": "builtin://smollm2-135m"}},
        FULL_SPEC,
        with_value("engine.speculative", {"method": "ngram", "numTokens": 3}),
        with_value(
            "resources", {"gpus": 0, "cpu": 4, "memory": "8Gi"}, with_value("engine.tensorParallelSize", 1)
        ),
        with_value("autoscaling", {"enabled": True, "minReplicas": 3, "maxReplicas": 3, "target": 1}),
        with_value(
            "lifecycle", {"preStopSeconds": 0, "drainTimeoutSeconds": 0, "terminationGracePeriodSeconds": 1}
        ),
        with_value("lifecycle", {"preStopSeconds": 10, "drainTimeoutSeconds": 60}),
    ],
    ids=["minimal", "full", "ngram", "cpu-int", "autoscale-fixed", "grace-min", "grace-default"],
)
def test_valid_examples_pass_all_three(spec):
    errors, cel, accepted = verdicts(cr(spec))
    assert errors == [] and cel == [] and accepted, (errors, cel)


CEL_CASES = [
    (
        "autoscaling",
        {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
        "minReplicas must be <= maxReplicas",
    ),
    ("autoscaling", {"metric": "kvCacheUsage", "target": 2}, "a kvCacheUsage target is a ratio <= 1"),
    ("engine.speculative", {"method": "draft"}, "draftModel is required when method is draft"),
    (
        "engine.speculative",
        {"method": "ngram", "draftModel": "hf://a/b"},
        "draftModel is only used with method draft",
    ),
    ("service", {"grpcPort": 9000, "httpPort": 9000}, "ports must differ"),
    (
        "lifecycle",
        {"preStopSeconds": 5, "drainTimeoutSeconds": 30, "terminationGracePeriodSeconds": 35},
        "terminationGracePeriodSeconds must exceed preStopSeconds + drainTimeoutSeconds",
    ),
    ("resources.gpus", 0, "tensorParallelSize must be 1 on the CPU and <= gpus on GPUs"),
    ("engine.tensorParallelSize", 4, "tensorParallelSize must be 1 on the CPU and <= gpus on GPUs"),
]


@pytest.mark.parametrize("path,value,message", CEL_CASES, ids=[c[2][:40] + c[0] for c in CEL_CASES])
def test_cel_rules_reject_and_pydantic_agrees(path, value, message):
    errors, cel, accepted = verdicts(cr(with_value(path, value)))
    assert errors == []
    assert any(message in v for v in cel), cel
    assert not accepted


def test_metadata_name_rule():
    for bad in ["Engine", "e" * 51, "1engine", "engine-"]:
        assert cel_violations(SCHEMA, apply_defaults(SCHEMA, cr(FULL_SPEC, name=bad))), bad
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, cr(FULL_SPEC, name="e" * 50))) == []


def test_every_cel_rule_is_exercised():
    triggered = set()
    for path, value, _ in CEL_CASES:
        obj = apply_defaults(SCHEMA, cr(with_value(path, value)))
        triggered |= {v.split(": ", 1)[1] for v in cel_violations(SCHEMA, obj)}
    messages = set()

    def collect(node: dict[str, Any]) -> None:
        messages.update(r["message"] for r in node.get("x-kubernetes-validations") or [])
        for sub in (node.get("properties") or {}).values():
            collect(sub)

    collect(SPEC_SCHEMA)
    assert len(messages) == len(all_rules(SPEC_SCHEMA))  # one message per rule
    assert messages <= triggered, messages - triggered


def _bounded_fields(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, sub in (node.get("properties") or {}).items():
        sub_path = f"{path}.{name}" if path else name
        if any(
            k in sub for k in ("minimum", "maximum", "enum", "pattern", "minLength", "maxLength", "maxItems")
        ):
            out.append((sub_path, sub))
        out += _bounded_fields(sub, sub_path)
    return out


def _cases(field: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(value, is_valid) pairs on and just past each bound of one field."""
    cases: list[tuple[Any, bool]] = []
    step = 1 if field.get("type") == "integer" else 0.01
    if "minimum" in field:
        lo = field["minimum"]
        cases += [(lo, not field.get("exclusiveMinimum")), (lo - step, False)]
    if "maximum" in field:
        cases += [(field["maximum"], True), (field["maximum"] + step, False)]
    if "enum" in field:
        cases += [(v, True) for v in field["enum"]] + [
            ("bogus" if field.get("type") == "string" else 7, False)
        ]
    if "pattern" in field:
        cases += [("30s", True), ("thirty", False)]
    if "minLength" in field:
        cases += [("", False)]
    if "maxLength" in field:
        cases += [("x" * (field["maxLength"] + 1), False)]
    if "maxItems" in field:
        cases += [(["a"] * (field["maxItems"] + 1), False)]
    return cases


BOUNDS = [(p, v, ok) for p, f in _bounded_fields(SPEC_SCHEMA) for v, ok in _cases(f)]


@pytest.mark.parametrize("path,value,is_valid", BOUNDS, ids=[f"{p}={str(v)[:12]}" for p, v, _ in BOUNDS])
def test_every_schema_bound(path, value, is_valid):
    errors, cel, accepted = verdicts(cr(with_value(path, value)))
    assert (errors == []) == is_valid, errors
    # pydantic accepts exactly what both the schema and the CEL rules accept.
    assert accepted == (not errors and not cel), f"pydantic disagrees on {path}={value!r}: {errors} {cel}"


def test_required_fields():
    for path in [
        "model",
        "model.uri",
        "engine.speculative.method",
        "modelCache.size",
        "auth.apiKeySecretRef",
    ]:
        errors, _, accepted = verdicts(cr(with_value(path, _DELETE)))
        assert errors and not accepted, path
