#!/usr/bin/env bash
# Downloads (here, with network) the wheels of bench/vllm_serve_wheels.txt into the git-ignored
# .vw/serve/ (beside the carried vLLM of ../shared/vllm-peer/fetch.sh .vw) and checks their sha256.
# bench/run_gpu.sh installs .vw/serve/*.whl into /tmp/vsite-serve on the GPU machine (carry
# ".vw/serve" in that call: ~0.2 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=bench/vllm_serve_wheels.txt
mkdir -p .vw/serve
grep -qx '/.vw/' .git/info/exclude 2>/dev/null || echo '/.vw/' >>.git/info/exclude
pins=$(grep -v '^#' "$LIST" | awk 'NF {print $2}' | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
# shellcheck disable=SC2086  # one pin per word
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .vw/serve $pins
(cd .vw/serve && grep -v '^#' "../../$LIST" | awk 'NF' | sha256sum --quiet -c -)
ls -l .vw/serve
