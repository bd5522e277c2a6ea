"""Rollouts on vLLM inside the training ranks: the engine wrapper, verified Megatron -> vLLM weight sync,
the colocate-and-offload scheduler, and trainer-side log-probs of given token ids."""
