"""Model URIs -> what the pod needs: the path `--model` gets, an optional download, volumes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedinfer.operator.errors import SpecError

MODELS_DIR = "/models"  # the model-cache volume (PVC or emptyDir)
MODELS_VOLUME = "models"
HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_BUILTIN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SCHEMES = ("builtin://", "hf://", "pvc://", "file://", "/")


@dataclass(frozen=True)
class Download:
    """One `pagedinfer download` the init container runs."""

    uri: str
    dest: str
    revision: str | None = None

    def args(self) -> list[str]:
        out = ["download", "--model", self.uri, "--dest", self.dest]
        return out + (["--revision", self.revision] if self.revision else [])


@dataclass(frozen=True)
class ModelSource:
    """Where the engine finds one model inside the pod."""

    serve_uri: str
    download: Download | None = None
    volumes: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    mounts: tuple[dict[str, Any], ...] = field(default_factory=tuple)


def resolve(uri: str, revision: str | None = None) -> ModelSource:
    """Map a model URI onto the pod; raises SpecError(reason="UnsupportedModelURI")."""
    if uri.startswith("builtin://"):
        name = uri.removeprefix("builtin://")
        _require(_BUILTIN.match(name), uri, "builtin://NAME")
        return ModelSource(serve_uri=uri)
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://")
        _require(HF_REPO.match(repo), uri, "hf://ORG/NAME")
        dest = f"{MODELS_DIR}/hf/{repo.replace('/', '--')}" + (f"@{revision}" if revision else "")
        return ModelSource(serve_uri=dest, download=Download(uri, dest, revision))
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        _require(_CLAIM.match(claim) and len(claim) <= 63, uri, "pvc://CLAIM/PATH")
        _require(".." not in path.split("/"), uri, "a path without '..'")
        volume = f"pvc-{claim}"[:63].rstrip("-")
        mount_path = f"{MODELS_DIR}/pvc/{claim}"
        return ModelSource(
            serve_uri=f"{mount_path}/{path}".rstrip("/"),
            volumes=({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
            mounts=({"name": volume, "mountPath": mount_path, "readOnly": True},),
        )
    if uri.startswith("file://") or uri.startswith("/"):
        path = uri.removeprefix("file://")
        _require(path.startswith("/") and ".." not in path.split("/"), uri, "an absolute path")
        return ModelSource(serve_uri=path)
    raise SpecError(
        "UnsupportedModelURI", f"model URI {uri!r} has no supported scheme (one of {', '.join(SCHEMES)})"
    )


def _require(ok: Any, uri: str, expected: str) -> None:
    if not ok:
        raise SpecError("UnsupportedModelURI", f"model URI {uri!r} is malformed: expected {expected}")
