"""megarlhf: RLHF / RLVR post-training on Megatron-Core with colocated vLLM rollouts."""
from setuptools import find_packages, setup

setup(
    name="megarlhf",
    version="0.1.0",
    packages=find_packages(include=["megarlhf*", "model_providers*", "parallel*"]),
    python_requires=">=3.11",
)
