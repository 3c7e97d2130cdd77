# vitserve images. Targets:
#   service  the service; --build-arg VARIANT=cpu (the default: python:3.11-slim, onnxruntime) or
#            VARIANT=gpu (an NVIDIA GPU: CUDA 13 + cuDNN 9 runtime, onnxruntime-gpu)
#   export   training and ONNX export (torch for the CPU)
#
#   docker build --target service --build-arg VARIANT=cpu -t vitserve:cpu .
#   docker build --target service --build-arg VARIANT=gpu -t vitserve:gpu .
#
# No `# syntax=` line: it makes BuildKit pull a Dockerfile frontend image before the first step,
# which fails behind a registry mirror or air-gapped; the builder's own frontend reads this file.
# The base images are build arguments (PYTHON_IMAGE, CUDA_IMAGE), so a build behind a mirror or
# air-gapped names its own copies (docs/containers.md).
#
# The two service images differ only in their base (base-cpu, base-gpu) and in the pinned
# requirements that the one `builder` stage installs into a virtual environment in /opt/venv; the
# rest of the image is the one `service` stage below, which BuildKit builds on base-${VARIANT}.
# Runtime stages copy the venv, so no compiler, pip cache or torch reaches a service image. Every
# requirement is a wheel (--only-binary=:all:), so nothing is compiled in the builder either. It
# then drops what the service never runs: pip and setuptools, the packages' own test suites, and
# onnxruntime's Python tools for building models (transformers, quantization, tools); about 50 MB.
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
# One builder makes the venv for both images; the stage under it, builder-${VARIANT}, gives it
# what differs: the base, the requirements file (as /tmp/requirements.txt) and, on Ubuntu, the
# python3-venv package (the slim Python image has venv built in).
FROM base-cpu AS builder-cpu
COPY requirements/serve.txt /tmp/requirements.txt

FROM base-gpu AS builder-gpu
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY requirements/serve-gpu.txt /tmp/requirements.txt

# DL3006 (tag images) is ignored on the two FROM lines that pick a stage of this file by VARIANT:
# hadolint does not expand the ARG, so it takes builder-${VARIANT} and base-${VARIANT} for untagged
# images; the images under those stages are the tagged ARGs above.
# hadolint ignore=DL3006
FROM builder-${VARIANT} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --only-binary=:all: -r /tmp/requirements.txt \
    && /opt/venv/bin/python -m pip uninstall --yes --quiet pip setuptools \
    && find /opt/venv -depth -type d -name tests -exec rm -rf {} + \
    && rm -rf /opt/venv/lib/python3*/site-packages/onnxruntime/transformers \
        /opt/venv/lib/python3*/site-packages/onnxruntime/quantization \
        /opt/venv/lib/python3*/site-packages/onnxruntime/tools

# --- the service, on either base -----------------------------------------------------------------
# PYTHONDONTWRITEBYTECODE: the root filesystem may be read-only (compose's read_only, Kubernetes'
# readOnlyRootFilesystem); /tmp is the only place the service writes, and only temporary files.
# XDG_CACHE_HOME: onnxruntime keeps its telemetry device ID under the cache directory; in /tmp it
# can write it even with a read-only root (elsewhere it warns at every start). The user has a home
# (HOME=/home/vitserve), for the tools that look there.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS service
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    VITSERVE_HOST=0.0.0.0 \
    VITSERVE_PORT=8000 \
    VITSERVE_HEALTH_PORT=8002 \
    VITSERVE_MODEL_REPOSITORY=/app/models
RUN groupadd --gid 10001 vitserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin vitserve
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
# TORCH=cpu (the default) installs torch for the CPU: PyPI's torch 2.13.0 for Linux is the CUDA
# build and pulls about 3 GB of NVIDIA wheels (nvidia-*, triton) that a CPU never loads. The CPU
# build, 2.13.0+cpu, satisfies the pin torch==2.13.0 and sorts above PyPI's 2.13.0, so pip takes it
# from TORCH_INDEX_URL (PyTorch's CPU index, or a mirror of it) or from a wheel put in wheels/
# (where no such index is reachable: `make image-test` puts this machine's there; the directory is
# mounted for the install, never copied into the image); the build stops if a CUDA torch got in all
# the same. TORCH=cuda takes PyPI's CUDA build (compose's export-gpu).
# The export imports the model contract from service/ (metadata, config.pbtxt, preprocessing,
# rollout), so it gets the serving requirements too. pip installs into this stage itself: a
# builder stage would copy the 1.3 GB environment once more for nothing (this image is for
# training, and keeps pip). --no-compile: no bytecode for the thousands of modules of torch, sympy,
# matplotlib and the rest, of which a run imports a part: a smaller image and a faster build, for
# compiling what a run imports at each start (the image runs long training and export jobs).
FROM ${PYTHON_IMAGE} AS export
ARG TORCH=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/.cache
# Fashion-MNIST's IDX files, in /usr/share/datasets/fashion-mnist (export/data.py's default).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends dataset-fashion-mnist \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 vitserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin vitserve
COPY requirements/serve.txt requirements/export.txt /tmp/
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \
    if [ "$TORCH" = cpu ]; then \
        set -- --find-links /tmp/wheels ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}; \
    else set --; fi \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-compile --only-binary=:all: "$@" \
        -r /tmp/serve.txt -r /tmp/export.txt \
    && /opt/venv/bin/python -c "import os, sys, torch; \
want = os.environ['TORCH']; got = 'cuda' if torch.version.cuda else 'cpu'; \
sys.exit(got != want and f'TORCH={want}, but pip installed torch {torch.__version__} ({got}): \
see the TORCH_INDEX_URL note in the Dockerfile')"
WORKDIR /app
COPY export/ /app/export/
COPY service/ /app/service/
RUN mkdir -p /app/models /app/runs && chown 10001:10001 /app/models /app/runs
USER 10001:10001
CMD ["python", "-m", "export.pipeline", "--preset", "fashion-small", "--dataset", "fashion-mnist", \
     "--out", "runs/fashion-small", "--name", "fashion-mnist-vit", "--version", "1", "--repo", "models"]
