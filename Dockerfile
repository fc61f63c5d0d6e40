# The image the Helm chart runs: every service is `pagedserve <command>`.
# GPU nodes: the default torch wheel from PyPI is a CUDA build. For a CPU-only image pass
#   --build-arg TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
FROM python:3.12-slim

ARG TORCH_SPEC=torch
WORKDIR /opt/pagedserve
RUN pip install --no-cache-dir ${TORCH_SPEC}
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY services services
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY pagedserve pagedserve
# the wheel generates its gRPC stubs at build time and installs one import root, pagedserve
RUN pip install --no-cache-dir '.[triton]'

ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
