"""docs/operator.md has one row per field of operator/spec.py and names every phase and condition."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from pagedinfer.operator.spec import InferenceEngineSpec
from pagedinfer.operator.status import ConditionType, Phase

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"
SECTION = "## Spec, field by field"
ROW_RE = re.compile(r"^\| `([A-Za-z.]+)` \|", re.MULTILINE)


def _spec_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field's dotted camelCase path, nested models included (`engine.speculative.numTokens`)."""
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        paths.append(path)
        for arg in typing.get_args(field.annotation) or (field.annotation,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths += _spec_paths(arg, path + ".")
    return paths


def _documented_paths() -> list[str]:
    text = DOC.read_text()
    assert SECTION in text, f"docs/operator.md lacks {SECTION!r}"
    return ROW_RE.findall(text.split(SECTION, 1)[1].split("\n## ", 1)[0])


def test_every_spec_field_has_a_row():
    missing = [p for p in _spec_paths(InferenceEngineSpec) if p not in _documented_paths()]
    assert not missing, f"docs/operator.md ({SECTION}) lacks rows for spec fields: {', '.join(missing)}"


def test_every_row_is_a_spec_field():
    gone = sorted(set(_documented_paths()) - set(_spec_paths(InferenceEngineSpec)))
    assert not gone, (
        f"docs/operator.md ({SECTION}) has rows for fields operator/spec.py lacks: {', '.join(gone)}"
    )


def test_every_phase_and_condition_is_named():
    text = DOC.read_text()
    for value in [p.value for p in Phase] + [c.value for c in ConditionType]:
        assert f"`{value}`" in text, f"docs/operator.md does not name {value!r}"
