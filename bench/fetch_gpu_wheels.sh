#!/usr/bin/env bash
# Downloads (here, with network) the pure-Python and small binary wheels that the bare GPU
# machine lacks, into the git-ignored folder .whl/, for CPython 3.12 x86-64. bench/run_gpu.sh
# installs them there with --no-index. torch, triton, transformers, numpy, tokenizers,
# safetensors, prometheus-client and jinja2 are already on that machine and are not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
PY=${PYTHON:-.venv/bin/python}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64; do
  PLATFORMS+=(--platform "$p")
done
# Versions match the CPU venv so generated protobuf/gRPC code behaves the same on both machines.
PKGS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 httptools==0.9.0 uvloop==0.23.0 websockets==17.4
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  gguf==0.19.0 openai==3.57.0 jiter==0.19.0 distro sniffio==1.3.1 anyio==4.16.0
  opentelemetry-api==1.45.2 annotated-doc grpcio-tools==1.85.1 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 idna==3.20 certifi
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2  # structured outputs (engine/structured)
  pytest-xdist==3.8.0 execnet==2.1.2  # run_gpu.sh compiles the GPU kernel tests' kernels in parallel
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${PKGS[@]}"
du -sh .whl
