# syntax=docker/dockerfile:1.7
# paged-infer operator (Kopf). From the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/pagedinfer/operator:0.1.0 .
# The pagedinfer wheel goes in with --no-deps: the operator needs none of the engine's
# heavy dependencies (torch, tokenizers, ...), only docker/requirements-operator.txt.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY docker/requirements-operator.txt ./
RUN pip install --no-cache-dir -r requirements-operator.txt
COPY pyproject.toml README.md LICENSE ./
COPY native/ native/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir --no-deps /wheels/*.whl

FROM ${PYTHON_IMAGE} AS runtime
ARG UID=1000
RUN groupadd --gid "${UID}" pagedinfer \
    && useradd --uid "${UID}" --gid "${UID}" --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pagedinfer
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER ${UID}:${UID}
EXPOSE 8080
HEALTHCHECK --interval=20s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["pagedinfer"]
CMD ["operator", "--all-namespaces"]
