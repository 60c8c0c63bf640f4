"""Shared fixtures for the chart tests: a real `helm` and offline validators for what it renders.

helm comes from scripts/install_k8s_tools.sh (.tools/bin); its cache and config go to a
temporary folder so tests never touch ~/.cache or ~/.config.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "manifests" / "crd" / "inferenceengines.serving.pagedinfer.io.yaml"
# Oldest Kubernetes the charts support (kubeVersion >=1.30: the operator's engine pods use the
# preStop `sleep` action) and the newest schemas bundled.
K8S_VERSIONS = ("1.30", "1.37")
MONITORING_API = "monitoring.coreos.com/v1"


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


class Helm:
    """Runs the real helm binary with values passed as a JSON file."""

    def __init__(self, binary: str, home: Path) -> None:
        self.binary = binary
        self.env = {
            **os.environ,
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        self._values_dir = home / "values"
        self._values_dir.mkdir(parents=True, exist_ok=True)
        self._count = 0

    def run(self, *args: str, values: dict[str, Any] | None = None) -> str:
        cmd = [self.binary, *args]
        if values:
            self._count += 1
            path = self._values_dir / f"values-{self._count}.json"
            path.write_text(json.dumps(values))
            cmd += ["-f", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
        if proc.returncode != 0:
            raise HelmError(f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def template(
        self,
        chart: Path,
        values: dict[str, Any] | None = None,
        release: str = "pi",
        namespace: str = "serving",
    ) -> list[dict[str, Any]]:
        out = self.run("template", release, str(chart), "--namespace", namespace, values=values)
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def lint(self, chart: Path, values: dict[str, Any] | None = None) -> str:
        return self.run("lint", "--strict", str(chart), values=values)

    def notes(self, chart: Path, values: dict[str, Any] | None = None, namespace: str = "serving") -> str:
        """NOTES.txt as `helm install` prints it (client-side dry run, no cluster)."""
        out = self.run(
            "install", "pi", str(chart), "--dry-run=client", "--namespace", namespace, values=values
        )
        return out.split("NOTES:", 1)[1] if "NOTES:" in out else ""


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    binary = ROOT / ".tools" / "bin" / "helm"
    found = str(binary) if binary.is_file() else shutil.which("helm")
    assert found, "helm not found: run scripts/install_k8s_tools.sh (scripts/setup.sh --dev does)"
    return Helm(found, tmp_path_factory.mktemp("helm"))


def crd_to_jsonschema(node: Any) -> Any:
    """A CRD structural schema as a strict JSON schema (what the API server enforces with
    strict field validation): int-or-string becomes a type union, unknown fields fail."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "x-kubernetes-int-or-string":
            out["type"] = ["integer", "string"]
        elif key == "x-kubernetes-preserve-unknown-fields":
            out["additionalProperties"] = True
        elif key == "properties":
            out[key] = {name: crd_to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = crd_to_jsonschema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [crd_to_jsonschema(v) for v in value]
        elif not key.startswith("x-kubernetes-"):
            out[key] = value
    _numeric_exclusive_bounds(out)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _numeric_exclusive_bounds(out: dict[str, Any]) -> None:
    """OpenAPI 3.0 (CRDs): `minimum: 0, exclusiveMinimum: true`; JSON schema draft 6+:
    `exclusiveMinimum: 0`."""
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True and bound in out:
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            del out[exclusive]


def _dropped_keys(sent: Any, kept: Any, path: str = "") -> list[str]:
    """Keys of `sent` that a pydantic round trip lost: fields the model does not know."""
    if isinstance(sent, dict) and isinstance(kept, dict):
        lost = []
        for key, value in sent.items():
            if key not in kept:
                lost.append(f"{path}.{key}")
            else:
                lost += _dropped_keys(value, kept[key], f"{path}.{key}")
        return lost
    if isinstance(sent, list) and isinstance(kept, list):
        return [
            k
            for i, (a, b) in enumerate(zip(sent, kept, strict=False))
            for k in _dropped_keys(a, b, f"{path}[{i}]")
        ]
    return []


class BuiltinSchemas:
    """kubernetes-validate's bundled strict OpenAPI schemas with one compiled validator per
    (Kubernetes version, apiVersion, kind); its own validate() re-reads the large definitions
    file on every call, which made the chart tests several times slower."""

    def __init__(self) -> None:
        self._validators: dict[tuple[str, str, str], Any] = {}

    def validate(self, obj: dict[str, Any], version: str) -> None:
        key = (version, obj["apiVersion"], obj["kind"])
        if key not in self._validators:
            self._validators[key] = self._build(*key)
        self._validators[key].validate(obj)

    @staticmethod
    def _build(version: str, api_version: str, kind: str) -> Any:
        from kubernetes_validate import utils
        from referencing import Registry, Resource

        full = [v for v in utils.all_versions() if utils.major_minor(v) <= version][-1]
        group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        folder = f"kubernetes-json-schema/v{full}-local-strict"
        try:
            schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
        except FileNotFoundError as e:
            raise kubernetes_validate.SchemaNotFoundError(
                version=version, kind=kind, api_version=api_version
            ) from e
        definitions = utils.schema_contents(f"{folder}/_definitions.json", version)
        registry = Resource.from_contents(schema) @ Registry()
        registry = Resource.from_contents(definitions) @ registry
        return jsonschema.validators.Draft202012Validator(schema, registry=registry)


class Validator:
    """Validates one rendered object offline, by kind:
    built-in kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, strict);
    custom resources of the project's CRDs against their openAPIV3Schema (InferenceEngine also
    through the operator's own pydantic spec);
    monitoring.coreos.com kinds against pydantic models generated from the Prometheus
    Operator CRDs (cloudcoil), strictly: a field the model drops is an unknown field."""

    def __init__(self) -> None:
        # Every CRD the project ships (InferenceEngine, Kopf's peering kinds), by (apiVersion, kind).
        self.crd_schemas: dict[tuple[str, str], dict[str, Any]] = {}
        for path in sorted(CRD_FILE.parent.glob("*.yaml")):
            for crd in yaml.safe_load_all(path.read_text()):
                for version in crd["spec"]["versions"]:
                    key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                    schema = crd_to_jsonschema(version["schema"]["openAPIV3Schema"])
                    # The API server always accepts these at a custom resource's root.
                    for field, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
                        schema.setdefault("properties", {}).setdefault(field, {"type": kind})
                    self.crd_schemas[key] = schema
        self.builtin = BuiltinSchemas()

    def __call__(self, obj: dict[str, Any]) -> None:
        api_version, kind = obj["apiVersion"], obj["kind"]
        if (api_version, kind) in self.crd_schemas:
            jsonschema.validate(obj, self.crd_schemas[api_version, kind])
            if kind == "InferenceEngine":
                self._inference_engine(obj)
        elif api_version == MONITORING_API:
            self._monitoring(obj)
        else:
            for version in K8S_VERSIONS:
                self.builtin.validate(obj, version)

    @staticmethod
    def _inference_engine(obj: dict[str, Any]) -> None:
        from pagedinfer.operator.spec import InferenceEngineSpec

        InferenceEngineSpec.model_validate(obj["spec"])  # also the rules CEL enforces on a cluster

    @staticmethod
    def _monitoring(obj: dict[str, Any]) -> None:
        from cloudcoil.models.prometheus_operator import v1

        model = getattr(v1, obj["kind"]).model_validate(obj)
        kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
        lost = _dropped_keys(obj, kept)
        assert not lost, f"{obj['kind']} has fields its CRD does not define: {lost}"


@pytest.fixture(scope="session")
def validate() -> Validator:
    return Validator()
