# The CUDA image the Helm chart runs: every service is `pagedserve <command>`.
# Stage 1 builds the wheel (its gRPC stubs are generated at build time); stage 2 installs it with
# a CUDA torch from PyPI (the driver comes from the node) and a C compiler, which Triton needs to
# build its launchers at run time. CPU nodes: Dockerfile.cpu.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY services services
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY pagedserve pagedserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
# gcc and the libc headers: Triton compiles a small C launcher per kernel on first use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/pagedserve-*.whl)[triton]" && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /cache pagedserve
# A read-only root filesystem: every cache is under /cache (an emptyDir in the chart).
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HOME=/cache XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface TRITON_CACHE_DIR=/cache/triton
USER 10001:10001
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
