"""Rendering helpers shared by the builder tests."""

from __future__ import annotations

from typing import Any

from pagedinfer.operator.builders.deployment import RenderInput
from pagedinfer.operator.builders.meta import EngineRef
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.spec import InferenceEngineSpec

REF = EngineRef(name="llama", namespace="ml", uid="uid-123", generation=2)


def render_input(spec: dict[str, Any], config: OperatorConfig | None = None) -> RenderInput:
    return RenderInput(REF, InferenceEngineSpec.model_validate(spec), config or OperatorConfig())


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == "engine")


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None
