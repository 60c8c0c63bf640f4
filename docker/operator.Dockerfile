# syntax=docker/dockerfile:1.7
# paged-infer operator (Kopf). From the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/pagedinfer/operator:0.1.0 .
# Without a registry (podman, a debootstrap Debian base): docker/build_local_images.sh.
# The pagedinfer wheel goes in with --no-deps: the operator needs none of the engine's
# heavy dependencies (torch, tokenizers, ...), only docker/requirements-operator.txt.
# BASE_IMAGE: a Python image (the default) or a bare Debian bookworm such as the debootstrap
# one (localhost/debian:bookworm-local); where the base has no python3, Debian's python3.11
# is installed with apt.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
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
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY docker/requirements-operator.txt ./
RUN pip install --no-cache-dir -r requirements-operator.txt
COPY pyproject.toml README.md LICENSE ./
COPY native/ native/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir --no-deps /wheels/*.whl \
    && pip uninstall -y pip setuptools \
    && python -c "from pagedinfer.engine.cli import build_parser; build_parser(); import pagedinfer.operator.handlers"

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
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER ${UID}:${UID}
EXPOSE 8080
HEALTHCHECK --interval=20s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["pagedinfer"]
CMD ["operator", "--all-namespaces"]
