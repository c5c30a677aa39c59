# syntax=docker/dockerfile:1
# specserve images: the server only (loadtests/, benchmarks/ and tests/ stay out: .dockerignore).
# The default (last) target is `gpu`, for NVIDIA nodes; `cpu` runs anywhere.
#   docker build -t specserve:gpu .
#   docker run --gpus all --ipc=host -p 8000:8000 specserve:gpu
#   docker build -t specserve:cpu --target cpu .
#   docker run --shm-size=2g -p 8000:8000 specserve:cpu
# Everything after the image name is `specserve serve` arguments, e.g.
# --speculative-config '{"method": "ngram"}'.
# What is installed is pinned: deploy/requirements-{cpu,gpu}.lock (`python deploy/lock.py cpu|gpu`),
# installed with --no-deps, then the project itself (not editable). Both targets are Debian
# bookworm with its python3 (3.11); the CUDA libraries come with PyPI's torch wheel (nvidia-*
# packages), the driver from the NVIDIA container toolkit. docs/deploy.md says how they were built.

ARG BASE_IMAGE=debian:bookworm-slim

# ---- cpu: build -------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS cpu-build
# torch's +cpu build (the lock pins torch==<version>+cpu) is on PyTorch's CPU index, not PyPI
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY deploy/requirements-cpu.lock ./requirements.lock
RUN python3 -m venv .venv \
    && .venv/bin/pip install --no-deps --extra-index-url "${TORCH_INDEX_URL}" -r requirements.lock
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY spec_phases ./spec_phases
COPY kv_cache ./kv_cache
COPY kernels ./kernels
RUN .venv/bin/pip install --no-deps --no-build-isolation .

# ---- cpu: runtime -----------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS cpu
# a C compiler: the CPU kernels (kernels/cpu/*.c) are built for the CPU they run on, at first use
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 specserve && useradd --uid 10001 --gid 10001 --create-home specserve \
    && install -d -o 10001 -g 10001 /home/specserve/.cache/specserve /models
COPY --from=cpu-build /app/.venv /app/.venv
WORKDIR /app
# the cache (GGUF tensors, compiled kernels) is ~/.cache/specserve: mount a volume there to start
# warm (deploy/docker-compose.yml, deploy/k8s/deployment.yaml); models from a volume at /models
ENV PATH=/app/.venv/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    SPECSERVE_CACHE_DIR=/home/specserve/.cache/specserve
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", \
         "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["specserve", "serve"]

# ---- gpu: build -------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS gpu-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY deploy/requirements-gpu.lock ./requirements.lock
RUN python3 -m venv .venv && .venv/bin/pip install --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY spec_phases ./spec_phases
COPY kv_cache ./kv_cache
COPY kernels ./kernels
RUN .venv/bin/pip install --no-deps --no-build-isolation .

# ---- gpu: runtime (default target) ------------------------------------------------------------
FROM ${BASE_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher on first use: it needs a C compiler and the Python headers.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 specserve && useradd --uid 10001 --gid 10001 --create-home specserve \
    && install -d -o 10001 -g 10001 /home/specserve/.cache/specserve /models
COPY --from=gpu-build /app/.venv /app/.venv
WORKDIR /app
ENV PATH=/app/.venv/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    SPECSERVE_CACHE_DIR=/home/specserve/.cache/specserve \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", \
         "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["specserve", "serve"]
