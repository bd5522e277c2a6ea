"""megarlhf: RLHF / RLVR post-training of Megatron-Core models with colocated vLLM rollouts."""

__version__ = "0.1.0"
