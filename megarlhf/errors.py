"""Errors shared across megarlhf's layers (kept free of heavy imports so every layer can raise them)."""


class CheckpointError(ValueError):
    """A checkpoint (HF directory or Megatron distributed checkpoint) is missing, incomplete, incompatible
    with the model, or cannot be written; the message names the path and what is wrong."""
