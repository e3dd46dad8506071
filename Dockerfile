# One image for every HarmonAIze service of docker-compose.yml: broker-init, api, bootstrap, fleet-monitor, the host
# agents (which start torchrun nodes, so the image carries PyTorch) and tenant controllers. The broker and the
# database run from their official images.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CPU build of PyTorch first, in a layer of its own: a bare `torch` requirement would pull the multi-GB CUDA
# build, and this layer stays cached while the project changes. The project's `torch>=2.4` is then already met.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY harmonaize ./harmonaize
COPY harmonaize_cli ./harmonaize_cli
COPY broker_config ./broker_config
COPY api ./api
COPY provider_agents ./provider_agents
COPY tenant_controllers ./tenant_controllers
COPY workloads ./workloads
# The image runs every service (API, agents with their torchrun nodes, controllers): the whole stack.
RUN pip install /app[all]

# Non-root. The mount points exist in the image, owned by that user, so named volumes mounted there start writable.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin hz \
 && mkdir -p /var/lib/harmonaize/broker /var/lib/harmonaize/demo /var/lib/harmonaize/checkpoints \
 && chown -R hz:hz /var/lib/harmonaize
USER hz
ENV HZ_DATA_DIR=/var/lib/harmonaize

EXPOSE 8080
# Names the image's builds, so that superseded ones (untagged by a rebuild) can be found and pruned.
LABEL org.opencontainers.image.title=harmonaize
CMD ["harmonaize", "--help"]
