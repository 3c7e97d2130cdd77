# syntax=docker/dockerfile:1
#
# vitserve images. Targets:
#   service  the service; --build-arg VARIANT=cpu (the default: python:3.11-slim, onnxruntime) or
#            VARIANT=gpu (an NVIDIA GPU: CUDA 13 + cuDNN 9 runtime, onnxruntime-gpu)
#   export   training and ONNX export (torch)
#
#   docker build --target service --build-arg VARIANT=cpu -t vitserve:cpu .
#   docker build --target service --build-arg VARIANT=gpu -t vitserve:gpu .
#
# The two service images differ only in their base (base-cpu, base-gpu) and in the virtual
# environment their builder makes in /opt/venv from the pinned requirements; the rest of the image
# is the one `service` stage below, which BuildKit builds on base-${VARIANT}. Runtime stages copy
# the venv, so no compiler, pip cache or torch reaches a service image. Every requirement is a wheel
# (--only-binary=:all:), so nothing is compiled in the builders either.
#
# Why apt packages are not pinned (hadolint DL3008, ignored on each apt line below): the base image
# tag fixes the distribution release, and the archive drops superseded package versions as security
# updates land, so an exact pin would stop resolving within weeks.

# onnxruntime-gpu 1.31.1 (requirements/serve-gpu.txt) is built against CUDA 13.0 and cuDNN 9.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Which service image `--target service` builds: cpu or gpu.
ARG VARIANT=cpu

# --- the bases of the two service images ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu

# Ubuntu 24.04's own Python (3.12): the pinned wheels exist for it, and the GPU builder below gets
# the same interpreter from this same base, so the copied venv's python link resolves.
FROM ${CUDA_IMAGE} AS base-gpu
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

# --- builders: the service's virtual environment ------------------------------------------------
FROM base-cpu AS builder-cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY requirements/serve.txt /tmp/requirements.txt
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: -r /tmp/requirements.txt

FROM base-gpu AS builder-gpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY requirements/serve-gpu.txt /tmp/requirements.txt
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: -r /tmp/requirements.txt

# DL3006 (tag images) is ignored on the two FROM lines that pick a stage of this file by VARIANT:
# hadolint does not expand the ARG, so it takes builder-${VARIANT} and base-${VARIANT} for untagged
# images; the images under those stages are the tagged ARGs above.
# hadolint ignore=DL3006
FROM builder-${VARIANT} AS builder

# --- the service, on either base -----------------------------------------------------------------
# PYTHONDONTWRITEBYTECODE: the root filesystem may be read-only (compose's read_only, Kubernetes'
# readOnlyRootFilesystem); /tmp is the only place the service writes, and only temporary files.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS service
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VITSERVE_HOST=0.0.0.0 \
    VITSERVE_PORT=8000 \
    VITSERVE_HEALTH_PORT=8002 \
    VITSERVE_MODEL_REPOSITORY=/app/models
RUN groupadd --gid 10001 vitserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin vitserve
WORKDIR /app
COPY --from=builder /opt/venv /opt/venv
COPY service/ /app/service/
# The shipped model; mount a model repository over /app/models to serve another.
COPY models/ /app/models/
USER 10001:10001
# HTTP; 8001 is gRPC when enabled (VITSERVE_GRPC_PORT); 8002 answers only the probes
# (VITSERVE_HEALTH_PORT, from the supervisor process, which does no request work), and the
# healthcheck asks there (the HTTP port when it is set to 0).
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = int(os.environ.get('VITSERVE_HEALTH_PORT') or 0) or os.environ.get('VITSERVE_PORT', '8000'); urllib.request.urlopen(f\"http://127.0.0.1:{port}/health/ready\", timeout=4)"]
CMD ["python", "-m", "service"]

# --- export: train and export to ONNX -----------------------------------------------------------
# PyPI's torch 2.13.0 for Linux brings its own CUDA libraries, so this image trains on a GPU when
# one is reserved for it and on the CPU otherwise.
# The export stage imports the model contract from service/ (metadata, config.pbtxt, preprocessing,
# rollout), so it gets the serving requirements too.
FROM ${PYTHON_IMAGE} AS builder-export
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY requirements/serve.txt requirements/export.txt /tmp/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: \
        -r /tmp/serve.txt -r /tmp/export.txt

FROM ${PYTHON_IMAGE} AS export
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
# Fashion-MNIST's IDX files, in /usr/share/datasets/fashion-mnist (export/data.py's default).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends dataset-fashion-mnist \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 vitserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin vitserve
WORKDIR /app
COPY --from=builder-export /opt/venv /opt/venv
COPY export/ /app/export/
COPY service/ /app/service/
RUN mkdir -p /app/models /app/runs && chown 10001:10001 /app/models /app/runs
USER 10001:10001
CMD ["python", "-m", "export.pipeline", "--preset", "fashion-small", "--dataset", "fashion-mnist", \
     "--out", "runs/fashion-small", "--name", "fashion-mnist-vit", "--version", "1", "--repo", "models"]
