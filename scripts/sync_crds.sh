#!/usr/bin/env bash
# Copies the operator's CRDs (manifests/crd/, generated from operator/spec.py) into the
# operator chart's crds/ byte for byte; tests/charts checks they stay identical.
#   scripts/sync_crds.sh          copy
#   scripts/sync_crds.sh --check  exit 1 (and list them) when any differs
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=manifests/crd
DEST=charts/pagedinfer-operator/crds
CHECK=0
[[ "${1:-}" == "--check" ]] && CHECK=1

shopt -s nullglob
sources=("$SRC"/*.yaml)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "sync_crds: no CRD in $SRC" >&2
  exit 1
fi
status=0
mkdir -p "$DEST"
for src in "${sources[@]}"; do
  dest="$DEST/$(basename "$src")"
  if cmp -s "$src" "$dest"; then
    continue
  fi
  if [[ $CHECK -eq 1 ]]; then
    echo "sync_crds: $dest differs from $src (run scripts/sync_crds.sh)" >&2
    status=1
  else
    cp "$src" "$dest"
    echo "sync_crds: updated $dest"
  fi
done
for dest in "$DEST"/*.yaml; do
  if [[ ! -f "$SRC/$(basename "$dest")" ]]; then
    echo "sync_crds: $dest has no source in $SRC" >&2
    status=1
  fi
done
exit $status
