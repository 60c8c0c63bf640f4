#!/usr/bin/env bash
# Every test of the project: lint, C++ (plain and ASan+UBSan) with ctest, then pytest.
# Expects scripts/setup.sh --dev to have run (the README's test command does both).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PWD/.venv/bin:$PATH"
JOBS=$(nproc)

# A real Kubernetes control plane for the tests marked `cluster` (tests/cluster, the operator's
# cluster backend): KUBECONFIG wins; else ../shared/k8s is started here (in the background while
# the C++ builds run) and stopped on exit; with neither those tests skip with one line saying why.
K8S=../shared/k8s
K8S_UP_LOG=build/k8s-up.log
K8S_STARTED=0
if [[ -n ${KUBECONFIG:-} ]]; then
  echo "== Kubernetes: the cluster of KUBECONFIG=$KUBECONFIG"
elif [[ -x $K8S/up.sh ]]; then
  mkdir -p build
  echo "== Kubernetes: starting the real control plane in $K8S (log: $K8S_UP_LOG)"
  KUBECTL=$PWD/.tools/bin/kubectl "$K8S/up.sh" >"$K8S_UP_LOG" 2>&1 &
  K8S_UP_PID=$!
  K8S_STARTED=1
  trap '"$K8S/down.sh" >/dev/null 2>&1 || true' EXIT
else
  echo "== Kubernetes: no KUBECONFIG and no $K8S: the real-cluster tests will be skipped"
fi

echo "== lint"
ruff check .
ruff format --check .
find native -name '*.cpp' -o -name '*.h' | xargs clang-format --dry-run -Werror
if [[ -f .importlinter ]]; then lint-imports; fi

echo "== C++ (release) + ctest"
cmake -S native -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDINFER_BUILD_TESTS=ON >/dev/null
cmake --build build/ctest -j "$JOBS"
ctest --test-dir build/ctest --output-on-failure -j "$JOBS"

echo "== C++ (AddressSanitizer + UndefinedBehaviorSanitizer) + ctest"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S native -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPAGEDINFER_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" >/dev/null
cmake --build build/asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure -j "$JOBS"

if [[ $K8S_STARTED -eq 1 ]]; then
  if ! wait "$K8S_UP_PID"; then
    cat "$K8S_UP_LOG"
    echo "the real control plane failed to start" >&2
    exit 1
  fi
  tail -n 1 "$K8S_UP_LOG"
  export KUBECONFIG=$PWD/.k8s/kubeconfig
  # A real node (pods run: tests/e2e) where its packages are installed (setup.sh --dev does).
  if command -v containerd >/dev/null && command -v podman >/dev/null; then
    echo "== Kubernetes: starting the real node"
    if ! "$K8S/node-up.sh" >build/k8s-node.log 2>&1; then
      cat build/k8s-node.log
      echo "the real node failed to start" >&2
      exit 1
    fi
    tail -n 1 build/k8s-node.log
  else
    echo "== Kubernetes: no containerd/podman: the node suite (tests/e2e) will be skipped"
  fi
fi

echo "== pytest"
python -m pytest -q "$@"
