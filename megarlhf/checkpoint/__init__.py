"""Checkpoints: atomic Megatron distributed checkpoints (:mod:`.distributed`) and HF <-> Megatron
conversion of whole model directories (:mod:`.convert`)."""
from megarlhf.checkpoint.distributed import (
    MARKER_FILE,
    CheckpointError,
    checkpoint_metadata,
    is_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["MARKER_FILE", "CheckpointError", "checkpoint_metadata", "is_complete_checkpoint",
           "load_checkpoint", "save_checkpoint"]
