"""gRPC stubs for proto/pagedinfer/v1/inference.proto, generated on demand.

Why generated, not committed: generated `_pb2` files pin the protobuf/grpcio versions of the
protoc that made them (they refuse to import under an older runtime), and the machines we run
on differ (CI's pip-resolved protobuf vs. the GPU host's preinstalled one). So the stubs are
made from the .proto with the local grpcio-tools: eagerly by `scripts/setup.sh` (which runs
`python -m pagedinfer.engine.server.proto_gen`) and lazily here on first import when missing
or stale (a hash of the .proto is written into each generated file). Where this package's
folder is read-only (a system install) they go to a per-user cache folder instead, which is
put on this package's `__path__`; `from pagedinfer.engine.server.proto_gen import
inference_pb2` works either way. tests/engine/server/test_proto.py regenerates and checks.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re
import tempfile
from pathlib import Path

PROTO_RELPATH = "pagedinfer/v1/inference.proto"
STUB_NAMES = ("inference_pb2.py", "inference_pb2_grpc.py")
_HASH_PREFIX = "# pagedinfer-proto-sha256: "


class ProtoStubError(RuntimeError):
    """The stubs are missing and cannot be generated (no .proto or no grpcio-tools)."""


def proto_root() -> Path:
    """The folder that holds pagedinfer/v1/inference.proto (the repository's proto/)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "proto" / PROTO_RELPATH).is_file():
            return parent / "proto"
    raise ProtoStubError(f"proto/{PROTO_RELPATH} not found above {here}")


def proto_hash(root: Path) -> str:
    return hashlib.sha256((root / PROTO_RELPATH).read_bytes()).hexdigest()[:16]


def _is_current(folder: Path, digest: str) -> bool:
    for name in STUB_NAMES:
        path = folder / name
        if not path.is_file():
            return False
        with path.open() as f:
            if f.readline().strip() != _HASH_PREFIX + digest:
                return False
    return True


def generate(out_dir: Path, root: Path | None = None) -> Path:
    """Run grpc_tools.protoc on the .proto and write flat, relatively-importing stubs to out_dir."""
    try:
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ProtoStubError(
            "grpcio-tools is needed to generate the gRPC stubs: pip install grpcio-tools"
        ) from e
    root = root or proto_root()
    digest = proto_hash(root)
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={tmp}"]
        argv += [f"--grpc_python_out={tmp}", str(root / PROTO_RELPATH)]
        if protoc.main(argv) != 0:
            raise ProtoStubError(f"protoc failed on {root / PROTO_RELPATH}")
        out_dir.mkdir(parents=True, exist_ok=True)
        gen = Path(tmp) / Path(PROTO_RELPATH).parent
        for name in STUB_NAMES:
            text = (gen / name).read_text()
            # protoc writes `from pagedinfer.v1 import inference_pb2`; our stubs live in this package.
            text = re.sub(r"^from pagedinfer\.v1 import", "from . import", text, flags=re.M)
            staged = out_dir / f".{name}.{os.getpid()}"
            staged.write_text(f"{_HASH_PREFIX}{digest}\n{text}")
            os.replace(staged, out_dir / name)  # atomic: concurrent importers never see half a file
    return out_dir


def _cache_dir(digest: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pagedinfer" / f"proto_gen-{digest}"


def ensure_stubs() -> Path:
    """Return the folder holding current stubs, generating them if needed."""
    here = Path(__file__).resolve().parent
    try:
        root = proto_root()
    except ProtoStubError:
        if all((here / n).is_file() for n in STUB_NAMES):
            return here  # installed without the .proto: trust what was generated at install
        raise
    digest = proto_hash(root)
    for folder in (here, _cache_dir(digest)):
        if _is_current(folder, digest):
            return folder
    target = here if os.access(here, os.W_OK) else _cache_dir(digest)
    return generate(target, root)


_stub_dir = ensure_stubs()
if str(_stub_dir) not in __path__:
    __path__.append(str(_stub_dir))
