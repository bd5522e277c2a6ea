"""Data: local prompt/SFT sources (:mod:`.source`), RL prompt datasets with chat templates and length
filtering (:mod:`.prompts`), the resumable DP-sharded sampler (:mod:`.sampler`), SFT ids + loss masks
(:mod:`.sft`) and the synthetic arithmetic task (:mod:`.synthetic`, imported from there: it is also
``python -m megarlhf.data.synthetic``, which a package import of it would warn about)."""
from megarlhf.data.prompts import (PromptDataset, PromptExample, build_prompt_dataset, load_prompt_dataset,
                                   render_prompt, row_messages, uses_chat_template)
from megarlhf.data.sampler import PromptSampler
from megarlhf.data.sft import SFTDataset, SFTExample, build_sft_dataset, load_sft_dataset, sft_example
from megarlhf.data.source import read_jsonl, read_records

__all__ = [
    "PromptDataset", "PromptExample", "build_prompt_dataset", "load_prompt_dataset", "render_prompt",
    "row_messages", "uses_chat_template", "PromptSampler", "SFTDataset", "SFTExample", "build_sft_dataset",
    "load_sft_dataset", "sft_example", "read_jsonl", "read_records",
]
