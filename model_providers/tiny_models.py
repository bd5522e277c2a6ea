"""Tiny random HF models of every supported architecture, written as real HF directories.

Tests, examples and benchmarks cannot download anything, so they build their models here: an HF config,
random safetensors weights (deterministic given a seed) and a byte-level BPE tokenizer trained locally
with the ``tokenizers`` library on a small built-in corpus, saved with ``save_pretrained`` so that
transformers, vLLM and megarlhf all read the directory like a hub checkpoint.

The default shapes cover what the converters must get right: GQA (llama, qwen2, qwen3), plain multi-head
attention (mistral), tied embeddings (qwen2, like Qwen2-0.5B) and untied ones (the others), Qwen3's q/k
norm with a head_dim that is not hidden/heads, Llama-3 rope scaling with non-default parameters, and
head_dim 32 (vLLM's CPU attention accepts head_dim in {32, 64, 80, ...} only).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

TOKENIZER_VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# CHAT_TEMPLATE with tool support as Qwen2.5's has it: tools= are written into the system turn and tool results
# come back as a user turn in <tool_response> (for tests and demos of tool-calling prompts).
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n{% elif message['role'] != 'system' %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_COMMON = dict(vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=256, rms_norm_eps=1e-6,
               initializer_range=0.05, hidden_act="silu")

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3": dict(_COMMON, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "mistral": dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, sliding_window=None, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}

# Mixture-of-experts models: >= 6 experts and top-2 each; Qwen3-MoE with a dense first layer and renormalised
# top-k weights, Qwen2-MoE with its gated shared expert and plain top-k weights, Mixtral in every layer.
TINY_MOE_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(_COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False,
                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen2_moe": dict(_COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                      tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "mixtral": dict(_COMMON, hidden_size=128, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, sliding_window=None,
                    tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}
TINY_CONFIGS.update(TINY_MOE_CONFIGS)
# Router weights get a wider spread than the rest (ROUTER_STD), so that in the tiny models a token's top-k
# experts are chosen by clear margins and fp32 rounding differences between implementations do not flip
# them (near-tied routing is built on purpose where a test needs it).
ROUTER_STD = 1.0

QWEN2_0_5B_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=32768)


def tiny_corpus() -> list[str]:
    """A small deterministic English + arithmetic corpus (enough for a few hundred BPE merges)."""
    prose = [
        "The quick brown fox jumps over the lazy dog.",
        "A language model predicts the next token from the tokens before it.",
        "Reinforcement learning improves a policy from rewards given to its answers.",
        "The teacher asked the students to show their work and check the final answer.",
        "Question: what is the sum of the numbers? Answer: the sum is given below.",
        "User: please solve the problem step by step. Assistant: let us think about it.",
    ]
    arithmetic = [f"What is {a} + {b}? The answer is {a + b}. What is {a} times {b}? It is {a * b}."
                  for a in range(0, 40, 3) for b in range(1, 30, 4)]
    return prose * 20 + arithmetic


def train_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, corpus: list[str] | None = None,
                         pre_tokenizer=None, added_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on ``corpus`` (default :func:`tiny_corpus`), as a transformers
    fast tokenizer. A task's own texts as corpus give it whole-word tokens (shorter sequences).
    ``pre_tokenizer`` (a ``tokenizers`` pre-tokenizer) replaces the GPT-2-style byte-level split.
    ``added_tokens`` become single, non-special tokens after the trained vocabulary (as Qwen2.5's
    ``<tool_call>`` / ``</tool_call>``): the tokenizer then has ``vocab_size + len(added_tokens)`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(tiny_corpus() if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    return fast


def tiny_config(arch: str, **overrides):
    """The HF config of the tiny ``arch`` model, with any config field overridden."""
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise ValueError(f"no tiny model for architecture {arch!r}; known: {', '.join(sorted(TINY_CONFIGS))}")
    fields = {**copy.deepcopy(TINY_CONFIGS[arch]), **overrides}
    return AutoConfig.for_model(arch, **fields)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights: matrices ~ N(0, initializer_range), norms ~ 1 + N(0, 0.1), biases ~
    N(0, 0.1). Norms and biases are perturbed so that a mapping that drops or mixes them is caught."""
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif name.endswith("mlp.gate.weight"):  # an MoE router (transformers' in-memory name, every family)
            value = ROUTER_STD * noise
        elif name.endswith(".bias"):
            value = 0.1 * noise
        else:
            value = std * noise
        param.copy_(value.to(param.dtype))


def make_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    tokenizer_corpus: list[str] | None = None, tokenizer_vocab_size: int = TOKENIZER_VOCAB_SIZE,
                    added_tokens: tuple[str, ...] = (), **config_overrides) -> Path:
    """Writes a tiny random ``arch`` causal LM (config, safetensors, tokenizer, generation config).

    ``config_overrides`` change any config field, e.g. ``**QWEN2_0_5B_SHAPE`` with arch "qwen2";
    ``tokenizer_corpus`` / ``tokenizer_vocab_size`` choose what the tokenizer is trained on and
    ``added_tokens`` what it adds (:func:`train_tiny_tokenizer`).
    """
    from transformers import AutoModelForCausalLM

    tokenizer = train_tiny_tokenizer(tokenizer_vocab_size, tokenizer_corpus, added_tokens=added_tokens)
    overrides = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None, **config_overrides)
    config = tiny_config(arch, **overrides)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomize_(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    save_loadable_tokenizer(tokenizer, out, tokenizer_vocab_size, tokenizer_corpus, added_tokens)
    return out


def save_loadable_tokenizer(tokenizer, out: Path, vocab_size: int, corpus: list[str] | None,
                            added_tokens: tuple[str, ...] = ()) -> None:
    """Saves ``tokenizer`` next to the model's config so that ``AutoTokenizer`` (hence transformers, vLLM
    and megarlhf) splits text exactly as the tokenizer was trained to.

    transformers rebuilds some architectures' tokenizers from the vocabulary with a pre-tokenizer of its
    own (Qwen2's splits every digit and separates spaces from numbers); merges learned under another
    split would then never apply. In that case the tokenizer is trained again with the pre-tokenizer
    transformers will use, and the round trip is checked."""
    from transformers import AutoTokenizer

    sample = (tiny_corpus() if corpus is None else corpus)[:200]
    tokenizer.save_pretrained(out)
    loaded = AutoTokenizer.from_pretrained(out)
    if _token_ids(loaded, sample) == _token_ids(tokenizer, sample):
        return
    tokenizer = train_tiny_tokenizer(vocab_size, corpus, pre_tokenizer=loaded.backend_tokenizer.pre_tokenizer,
                                     added_tokens=added_tokens)
    tokenizer.save_pretrained(out)
    loaded = AutoTokenizer.from_pretrained(out)
    if _token_ids(loaded, sample) != _token_ids(tokenizer, sample):
        raise RuntimeError(f"{out}: the saved tokenizer loads as {type(loaded).__name__}, which tokenizes the "
                           "corpus differently from the trained tokenizer")


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
