# syntax=docker/dockerfile:1
# One image for every ringlab role in docker-compose.yml: api, scheduler, ray-head, ray-gpu-worker.
# Installed with the project's one install step, scripts/install.sh (pip -c constraints.txt), so the
# image, `make` and `ray up` (deploy/) share one list of pins. See docs/deploy.md.
#
# Build arguments:
#   BASE_IMAGE         the CUDA base image (its CUDA user-space must suit the host's NVIDIA driver).
#   TORCH_INDEX_URL    where the torch *build* comes from; its *version* is always constraints.txt's.
#                      Empty (default): PyPI, whose Linux x86_64 torch wheel is a CUDA build bringing
#                      its CUDA libraries as nvidia-* wheels. A PyTorch index picks another build,
#                      e.g. https://download.pytorch.org/whl/cu126 for an older driver, or
#                      https://download.pytorch.org/whl/cpu for a CPU-only image (with
#                      REQUIRE_CUDA_TORCH=0). pip prefers that index's 2.x.y+cuNNN over PyPI's 2.x.y.
#   REQUIRE_CUDA_TORCH 1 (default): the build fails unless the installed torch is a CUDA build, so an
#                      image meant for GPUs never silently carries the CPU build.
#   PYTHON             the interpreter from the base image's apt (3.11, as constraints.txt is tested).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
FROM ${BASE_IMAGE}

ARG PYTHON=python3.11
ARG TORCH_INDEX_URL=
ARG REQUIRE_CUDA_TORCH=1
ARG GIT_SHA=unknown
LABEL org.opencontainers.image.title="ringlab" \
      org.opencontainers.image.revision="${GIT_SHA}"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/ringlab \
    PATH=/opt/ringlab/bin:$PATH \
    RAY_USAGE_STATS_ENABLED=0

RUN apt-get update \
    && apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && "${PYTHON}" -m venv /opt/ringlab

WORKDIR /opt/ringlab-src

# torch first, in its own layer (the largest download; rebuilt only when the pins change).
COPY constraints.txt ./
COPY scripts/install.sh scripts/install.sh
RUN --mount=type=cache,target=/root/.cache/pip \
    bash scripts/install.sh /opt/ringlab/bin/python \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch \
    && /opt/ringlab/bin/python -c "import sys, torch; \
cuda = torch.version.cuda; print('torch', torch.__version__, 'CUDA', cuda); \
sys.exit(None if cuda or '${REQUIRE_CUDA_TORCH}' != '1' else \
'torch ' + torch.__version__ + ' is not a CUDA build: set TORCH_INDEX_URL, see docs/deploy.md')"

# Then ringlab and every other dependency, pinned by the same constraints.txt.
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    bash scripts/install.sh /opt/ringlab/bin/python . \
    && ringlab --help >/dev/null \
    && install -m 0755 deploy/docker-entrypoint.sh /usr/local/bin/ringlab-entrypoint

RUN useradd --create-home ringlab \
    && mkdir -p /var/lib/ringlab/artifacts && chown -R ringlab /var/lib/ringlab
USER ringlab
WORKDIR /home/ringlab
# Inside a container the service listens on every interface; docker-compose.yml publishes the
# port on the host's 127.0.0.1 only.
ENV RINGLAB_HOST=0.0.0.0 \
    RINGLAB_PORT=8000
EXPOSE 8000 6380 8265
ENTRYPOINT ["tini", "--", "ringlab-entrypoint"]
CMD ["ringlab", "serve"]
