"""LoRA on Megatron vs PEFT on the HF model, with the same adapter, at TP1, TP2 and PP2.

The reference is independent: transformers + peft in this process, on the tiny Qwen2 model (GQA, qkv
bias). Its adapter has random A and B (q/k/v sharing one A and gate/up another, as Megatron's fused
layers hold one A). The ranks (``_worker_lora.py``) load that adapter, and the test compares logits,
the base model's logits with adapters off, the adapters' gradients (a fused layer's A gradient is the
sum of PEFT's per-projection ones), the re-exported PEFT adapter (bit for bit, and loadable by PEFT)
and the merged HF export (loaded by transformers).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarlhf.testing.launch import run_torchrun
from model_providers.tiny_models import make_tiny_model
from parallel.lora import TARGET_KINDS

WORKER = Path(__file__).with_name("_worker_lora.py")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARED_A = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
TOL = 1e-5
# gradients, relative to the tensor's largest: fp32 rounding of two implementations (Megatron's fused gate/up GEMM,
# PEFT's separate ones) measured 3.5e-6 (shared A) to 2.3e-5 (canonical, TP2) on the 2-core CI machine's CPU,
# under 1e-5 on another; a wrong scaling, factor or missing term is off by orders of magnitude more
GRAD_TOL = 5e-5
# layout -> (TP, PP, worker option): tp2 also saves a distributed checkpoint, which tp1-from-tp2 loads
LAYOUTS = {"tp1": (1, 1, ""), "tp2": (2, 1, "save"), "pp2": (1, 2, ""), "tp1-recompute": (1, 1, "recompute"),
           "tp1-from-tp2": (1, 1, "load"), "tp1-canonical": (1, 1, "canonical"), "tp2-canonical": (2, 1, "canonical,save"),
           "tp1-canonical-from-tp2": (1, 1, "canonical,load")}


def _peft_model(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))


def _reference_adapter(model_dir: Path, out: Path, shared: bool) -> dict:
    """A random PEFT adapter of the tiny model written to ``out`` (``shared``: q/k/v share one A and gate/up
    another, as the fused layers hold them), and PEFT's logits, gradients and base logits with it."""
    import sys

    sys.path.insert(0, str(WORKER.parent))
    from _worker_lora import inputs

    peft_model = _peft_model(model_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, module in sorted(peft_model.named_modules()):
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                module.lora_A["default"].weight.normal_(0, 0.3, generator=gen)
                module.lora_B["default"].weight.normal_(0, 0.3, generator=gen)
        for name, module in peft_model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if shared and leaf in SHARED_A:
                source = peft_model.get_submodule(name.rsplit(".", 1)[0] + "." + SHARED_A[leaf])
                module.lora_A["default"].weight.copy_(source.lora_A["default"].weight)
    peft_model.save_pretrained(out)
    ids, pos, weights = inputs(peft_model.config.vocab_size)
    logits = peft_model(input_ids=ids).logits
    (logits * weights).sum().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}
    with peft_model.disable_adapter(), torch.no_grad():
        base_logits = peft_model(input_ids=ids).logits
    return {"adapter": out, "logits": logits.detach(), "base_logits": base_logits, "grads": grads, "ids": ids}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny model, a random PEFT adapter for it (shared A, the fused layers' layout) and PEFT's logits and
    gradients; ``reference["canonical"]``: the same for an adapter with an A per projection."""
    root = tmp_path_factory.mktemp("lora")
    model_dir = make_tiny_model("qwen2", root / "model", seed=3)
    make_tiny_model("qwen3_moe", root / "moe", seed=4)
    shared = _reference_adapter(model_dir, root / "adapter", shared=True)
    canonical = _reference_adapter(model_dir, root / "adapter_canonical", shared=False)
    return {**shared, "model": model_dir, "root": root, "canonical": canonical}


def _reference_of(reference: dict, layout: str) -> dict:
    return reference["canonical"] if "canonical" in layout else reference


@pytest.fixture(scope="module")
def layouts(reference):
    """``layouts("tp2")`` -> the output directory of that layout's run (run once)."""
    cache = {}

    def run(layout: str) -> Path:
        if layout not in cache:
            tp, pp, option = LAYOUTS[layout]
            if option.endswith("load"):  # the adapters from the checkpoint the TP2 run of that layout saved
                saver = "tp2-canonical" if "canonical" in option else "tp2"
                option = option.replace("load", f"load={run(saver) / 'ckpt'}")
            out = reference["root"] / layout
            adapter = _reference_of(reference, layout)["adapter"]
            run_torchrun(WORKER, tp * pp, [str(tp), str(pp), str(reference["model"]), str(adapter), str(out), option],
                         timeout_s=600)
            cache[layout] = out
        return cache[layout]
    return run


def _expected_grad(grads: dict, name: str, canonical: bool) -> torch.Tensor:
    """PEFT's gradient of the tensor megarlhf holds for ``name``: a shared A's gradient sums its group's
    (canonical: every factor is PEFT's own)."""
    key = name.removeprefix("base_model.model.")
    module, factor = key.rsplit(".lora_", 1)
    leaf = module.rsplit(".", 1)[-1]
    if canonical or not factor.startswith("A"):
        return grads[f"base_model.model.{key}"]
    owner = SHARED_A.get(leaf, leaf)
    group = [owner] + [k for k, v in SHARED_A.items() if v == owner]
    parent = module.rsplit(".", 1)[0]
    return sum(grads[f"base_model.model.{parent}.{g}.lora_A.weight"] for g in group)


SLOW = pytest.mark.slow  # one 1-2 rank launch each (~20 s): make test-slow


@pytest.mark.parametrize("layout", ["tp1", "tp2", pytest.param("pp2", marks=SLOW),
                                    pytest.param("tp1-recompute", marks=SLOW),
                                    pytest.param("tp1-from-tp2", marks=SLOW),
                                    pytest.param("tp1-canonical", marks=SLOW), "tp2-canonical",
                                    pytest.param("tp1-canonical-from-tp2", marks=SLOW)])
def test_lora_matches_peft(reference, layouts, layout):
    """Canonical layouts load a PEFT adapter whose q, k, v (gate, up) have different A factors: exactly."""
    out = layouts(layout)
    reference, canonical = _reference_of(reference, layout), "canonical" in layout
    info = json.loads((out / "info.json").read_text())
    assert info["adapters"] > 0 and info["fresh_merged_equal"]
    assert info["frozen_have_no_grad"] and info["replicated_grads_agree"]
    factor = r"_lora\.parts\.(query|key|value|gate|up)\.[AB]$|_lora\.[AB]$" if canonical else r"_lora\.[AB]$"
    assert all(re.search(factor, n) for n in info["trainable"]), info["trainable"]
    assert canonical == any(".parts." in n for n in info["trainable"])
    logits = torch.load(out / "logits.pt")
    assert (logits["logits"] - reference["logits"]).abs().max().item() <= TOL
    assert (logits["base_logits"] - reference["base_logits"]).abs().max().item() <= TOL
    assert (logits["logits"] - logits["base_logits"]).abs().max().item() > 0.1  # the adapter does act
    grads = load_file(str(out / "grads.safetensors"))
    assert set(grads) == set(reference["grads"])
    for name, grad in grads.items():
        expected = _expected_grad(reference["grads"], name, canonical)
        scale = expected.abs().max().item()
        assert (grad - expected).abs().max().item() <= GRAD_TOL * max(1.0, scale), name


@pytest.mark.parametrize("layout", ["tp1", "tp2", pytest.param("pp2", marks=SLOW),
                                    pytest.param("tp1-canonical", marks=SLOW), "tp2-canonical"])
def test_lora_exports_load_in_peft_and_transformers(reference, layouts, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = layouts(layout)
    reference = {**_reference_of(reference, layout), "model": reference["model"]}
    source, exported = load_file(str(reference["adapter"] / "adapter_model.safetensors")), \
        load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)
    base = AutoModelForCausalLM.from_pretrained(reference["model"], dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        assert (loaded(input_ids=reference["ids"]).logits - reference["logits"]).abs().max().item() <= TOL
        # the merged export against PEFT's own merge (merged and unmerged logits of the canonical adapter
        # differ by 5e-5 in fp32 in PEFT itself)
        peft_merged = loaded.merge_and_unload()(input_ids=reference["ids"]).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
        assert (merged(input_ids=reference["ids"]).logits - peft_merged).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", ["tp1", "tp2", pytest.param("pp2", marks=SLOW), "tp2-canonical"])
def test_planner_counts_the_adapters_a_rank_holds(reference, layouts, layout):
    from megarlhf.planner.shapes import resolve_shape

    tp, pp, _ = LAYOUTS[layout]
    shape = resolve_shape(str(reference["model"]))[0]
    held = json.loads((layouts(layout) / "info.json").read_text())["adapter_params"]  # global rank 0's
    per_layer = shape.lora_layer_params(4, list(TARGET_KINDS), tp, canonical="canonical" in layout)
    assert held == shape.num_layers // pp * per_layer


def test_lora_bad_settings_are_named(layouts):
    errors = json.loads((layouts("tp1") / "info.json").read_text())["errors"]
    assert "rank must be an int >= 1, got 0" in errors["rank0"]
    assert "['q_proj']" in errors["unknown_target"] and "linear_qkv" in errors["unknown_target"]
    assert "targets nothing" in errors["empty_targets"]
    assert "alpha must be > 0" in errors["alpha"]
    assert "rank 10000 is larger than layer decoder.layers.0.self_attention.linear_qkv" in errors["rank_too_large"]
    assert "['linear_fc2'] match no layer" in errors["no_match"]
    unshared = errors["unshared_into_fused"]
    assert "q_proj.lora_A.weight" in unshared and "k_proj.lora_A.weight" in unshared, unshared
    assert "set model.lora.canonical=true" in unshared
    # LoRA on an MoE model adapted only its dense layer 0 while claiming linear_fc1/fc2: now refused by name
    assert ("LoRA targets ['linear_fc1', 'linear_fc2']: layers [1, 2] of this model are mixture-of-experts "
            "blocks" in errors["moe_mlp_targets"]), errors["moe_mlp_targets"]
    assert "model.lora.targets=['linear_qkv', 'linear_proj']" in errors["moe_mlp_targets"]
    assert errors["moe_attention_adapters"] == 3 * 2  # attention-only LoRA on every layer works
