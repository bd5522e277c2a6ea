"""Checkpoints: atomic Megatron distributed checkpoints (:mod:`.distributed`) and HF <-> Megatron
conversion of whole model directories (:mod:`.convert`)."""
from megarlhf.checkpoint.convert import hf_to_megatron, megatron_to_hf
from megarlhf.checkpoint.distributed import (
    MARKER_FILE,
    CheckpointError,
    checkpoint_metadata,
    is_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["MARKER_FILE", "CheckpointError", "checkpoint_metadata", "hf_to_megatron", "is_complete_checkpoint",
           "load_checkpoint", "megatron_to_hf", "save_checkpoint"]
