"""`pagedinfer download --model URI --dest DIR [--revision REV]`: fetch a model once into a cache.

Run by the engine pod's init container. A completed download leaves a marker naming the URI and
revision, so restarts and new replicas sharing the cache skip it; an interrupted one resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from pagedinfer.operator.builders.model_source import HF_REPO

MARKER = ".pagedinfer-complete"
# Weights, tokenizer and config; never the repository's other checkpoints (e.g. original/*.pth).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.gguf", "tokenizer*"]


class DownloadError(ValueError):
    """The URI cannot be downloaded (wrong scheme or malformed)."""


def is_complete(dest: Path, uri: str, revision: str | None) -> bool:
    marker = dest / MARKER
    if not marker.is_file():
        return False
    try:
        done = json.loads(marker.read_text())
    except ValueError:
        return False
    return done == {"uri": uri, "revision": revision}


def download(
    uri: str, dest: Path, revision: str | None = None, *, fetch: Callable[..., object] | None = None
) -> bool:
    """Fetch `uri` into `dest`; False when it was already complete. Raises DownloadError."""
    if uri.startswith("builtin://"):
        return False  # shipped inside the engine image
    if not uri.startswith("hf://"):
        raise DownloadError(
            f"cannot download {uri!r}: only hf://ORG/NAME is fetched (mount pvc:// and paths)"
        )
    repo = uri.removeprefix("hf://")
    if not HF_REPO.match(repo):
        raise DownloadError(f"malformed model URI {uri!r}: expected hf://ORG/NAME")
    if is_complete(dest, uri, revision):
        return False
    if fetch is None:
        from huggingface_hub import snapshot_download

        fetch = snapshot_download
    dest.mkdir(parents=True, exist_ok=True)
    fetch(repo_id=repo, revision=revision, local_dir=str(dest), allow_patterns=ALLOW_PATTERNS)
    (dest / MARKER).write_text(json.dumps({"uri": uri, "revision": revision}))
    return True


def add_download_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help="fetch a model into a directory (the operator's init container)")
    p.add_argument("--model", required=True, help="hf://ORG/NAME (builtin:// is a no-op)")
    p.add_argument("--dest", required=True, type=Path, help="directory to fill")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        fetched = download(args.model, args.dest, args.revision)
    except DownloadError as exc:
        print(f"pagedinfer download: {exc}", file=sys.stderr)
        return 2
    print(f"{'downloaded' if fetched else 'already present'}: {args.model} -> {args.dest}")
    return 0
