# syntax=docker/dockerfile:1
# An example engine for compose.yaml: the client with the engine extra, on the CPU build of
# torch, running a scripted `kvstore chat --random` (a small random Llama, no model file) whose
# KV blocks go to the daemon over the shared socket directory. Build from the repository root:
#   docker build -f deploy/engine.Dockerfile -t kvstore-engine:0.1.0 .

FROM python:3.11-slim
# Group 10001 is the daemon's socket group (deploy/Dockerfile): engine joins it.
RUN groupadd --system --gid 10001 kvstore \
 && useradd --uid 10002 --user-group --groups kvstore --create-home --shell /usr/sbin/nologin \
      engine
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY kvstore kvstore
COPY wire wire
COPY tiers tiers
COPY client client
COPY protos protos
COPY kernels kernels
COPY inference_adapter inference_adapter
# The project with the engine extra at requirements.lock's versions; the lock's torch is the
# CPU build (2.13.0+cpu), which PyTorch's CPU wheel index holds (PyPI's would be a CUDA build).
RUN python -m venv /opt/kvstore \
 && /opt/kvstore/bin/pip install --no-cache-dir -c requirements.lock \
      --extra-index-url https://download.pytorch.org/whl/cpu ".[engine]"
ENV PATH=/opt/kvstore/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /home/engine
USER engine
# The daemon's socket, in the volume shared with it (mounted at the same path as there).
CMD ["kvstore", "chat", "--random", "--address", "unix:/run/kvstore/kvstore.sock", "--script"]
