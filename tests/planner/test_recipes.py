"""`megarlhf plan` on every shipped recipe: each layout of examples/recipes/layouts.yaml fits, each
refused one is refused with a suggestion that, applied, fits; the CPU recipes (demo, launch smoke test)
plan on CPU."""
import json
from pathlib import Path

import pytest
import yaml

from megarlhf.cli import main

RECIPES = Path(__file__).parents[2] / "examples" / "recipes"
LAYOUTS = yaml.safe_load((RECIPES / "layouts.yaml").read_text())
CASES = [(name, gpus, overrides) for name, sizes in LAYOUTS["layouts"].items() for gpus, overrides in sizes.items()]
# model and data come from overrides
CPU_RECIPES = ["demo_grpo.yaml", "demo_sft.yaml", "demo_sft_answer_first.yaml", "tiny_ppo.yaml", "demo_rm.yaml",
               "demo_dpo.yaml", "demo_grpo_learned_reward.yaml", "demo_sft_calculator.yaml",
               "demo_grpo_calculator.yaml", "smollm2_grpo_arithmetic.yaml", "smollm2_sft_arithmetic.yaml",
               "smollm2_sft_multistep.yaml", "smollm2_grpo_multistep.yaml", "smollm2_rs_multistep.yaml",
               "smollm2_online_dpo_multistep.yaml", "smollm2_sft_tools.yaml", "smollm2_grpo_tools.yaml",
               "smollm2_grpo_repo.yaml", "smollm2_grpo_openenv.yaml", "smollm2_sft_judge.yaml",
               "smollm2_grpo_judge.yaml", "smollm2_distill_arithmetic.yaml"]


def _command(recipe: str) -> str:
    """The megarlhf command that runs a shipped CPU recipe (its name says)."""
    for part, command in (("online_dpo", "online-dpo"), ("_rs", "rs"), ("_sft", "sft"), ("_dpo", "dpo"),
                          ("_rm", "rm")):
        if part in recipe:
            return command
    return "train"
REFUSED = [(name, gpus, overrides) for name, sizes in LAYOUTS["refused"].items() for gpus, overrides in sizes.items()]


def _plan(capsys, recipe, gpus, overrides, *flags):
    status = main(["plan", "--gpus", str(gpus), *flags, str(recipe), *overrides])
    return status, capsys.readouterr().out


def test_every_real_size_recipe_has_layouts():
    shipped = {p.name for p in RECIPES.glob("*.yaml")} - {"layouts.yaml", *CPU_RECIPES}
    assert shipped == set(LAYOUTS["layouts"]) and len(shipped) == 9
    smallest = {name: 16 if "a3b" in name else 8 for name in shipped}  # the 30 B MoE model needs two nodes
    assert all({smallest[name], 32} <= set(sizes) for name, sizes in LAYOUTS["layouts"].items())


@pytest.mark.parametrize("name,gpus,overrides", CASES)
def test_layout_fits(capsys, name, gpus, overrides):
    status, out = _plan(capsys, RECIPES / name, gpus, overrides)
    assert status == 0, out
    assert "fits: peak" in out and "vLLM KV cache" in out
    recomputes = "granularity: full" in (RECIPES / name).read_text()  # the comparison row is then the same figure
    assert recomputes or "activations (full recompute)" in out


@pytest.mark.parametrize("name,gpus,overrides", REFUSED)
def test_oversized_layout_is_refused_with_a_fitting_suggestion(capsys, name, gpus, overrides):
    status, out = _plan(capsys, RECIPES / name, gpus, overrides)
    assert status == 1 and "DOES NOT FIT" in out and "smallest changes that fit:" in out, out
    status, out = _plan(capsys, RECIPES / name, gpus, overrides, "--json")
    plan = json.loads(out)
    assert not plan["fits"] and plan["suggestions"]
    suggestion = plan["suggestions"][0].split("  (")[0].split()
    more_gpus = suggestion.index("--gpus") if "--gpus" in suggestion else None
    new_gpus = int(suggestion[more_gpus + 1]) if more_gpus is not None else gpus
    new_overrides = overrides + [s for i, s in enumerate(suggestion) if more_gpus is None or i not in (more_gpus, more_gpus + 1)]
    status, out = _plan(capsys, RECIPES / name, new_gpus, new_overrides)
    assert status == 0, out


def test_kv_cache_smaller_than_one_sequence_is_refused(capsys):
    status, out = _plan(capsys, RECIPES / "qwen2.5-0.5b_grpo.yaml", 8, ["rollout.kv_cache_mb=8"])
    assert status == 1 and "vLLM refuses to start" in out and "rollout.kv_cache_mb=" in out


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_cpu_recipes_plan_on_cpu(capsys, tmp_path, recipe):
    from model_providers.tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    learned = [f"reward.reward_model_path={model}"] if "learned_reward" in recipe else []
    learned += [f"reward.judge.model_path={model}"] if "grpo_judge" in recipe else []
    learned += [f"teacher.model_path={model}"] if "distill" in recipe else []
    status, out = _plan(capsys, RECIPES / recipe, 2, [f"model.path={model}", "data.train_path=x.jsonl", *learned],
                        "--device", "cpu", "--gpu-mem-gib", "24", "--command", _command(recipe))
    assert status == 0, out
    assert ("reward model weights" in out) == ("learned_reward" in recipe), out
    assert ("judge weights" in out) == ("grpo_judge" in recipe), out
    assert ("teacher weights" in out) == ("distill" in recipe), out
    assert ("vLLM KV cache" in out) == (_command(recipe) in ("train", "rs", "online-dpo")), out


@pytest.mark.parametrize("recipe", sorted(r for r in CPU_RECIPES if r.startswith("smollm2")))
def test_smollm2_recipes_plan_on_a_fresh_clone(capsys, tmp_path, monkeypatch, recipe):
    """Before `megarlhf fetch` wrote checkpoints/smollm2-135m-instruct, the recipe plans from the preset (the
    same numbers as the fetched config.json)."""
    import json as json_module

    monkeypatch.chdir(tmp_path)  # no checkpoints/ or runs/ here
    flags = ("--device", "cpu", "--gpu-mem-gib", "24", "--command", _command(recipe))
    if "runs/" in yaml.safe_load((RECIPES / recipe).read_text())["model"]["path"]:  # starts from an SFT run
        status = main(["plan", "--gpus", "2", *flags, str(RECIPES / recipe), "data.train_path=x.jsonl"])
        printed = capsys.readouterr()
        assert status != 0 and "has no config.json" in printed.err and "pass --arch PRESET" in printed.err, printed
        flags += ("--arch", "smollm2-135m-instruct")
    # a judge trained by the README's commands is not there either: the base model, named like the preset, plans
    judge = ["reward.judge.model_path=checkpoints/smollm2-135m-instruct"] if "grpo_judge" in recipe else []
    judge += ["teacher.model_path=checkpoints/smollm2-135m-instruct"] if "distill" in recipe else []  # the SFT run's
    status, out = _plan(capsys, RECIPES / recipe, 2, ["data.train_path=x.jsonl", *judge], *flags)
    assert status == 0 and "preset smollm2-135m-instruct" in out, out
    assert ("judge weights" in out) == ("grpo_judge" in recipe), out
    assert ("teacher weights" in out) == ("distill" in recipe), out
    fetched = Path(__file__).parents[2] / "checkpoints" / "smollm2-135m-instruct" / "config.json"
    if fetched.is_file():  # where the model was fetched, the preset and its config agree
        from megarlhf.planner.shapes import ModelShape, preset_for

        config = json_module.loads(fetched.read_text())
        assert ModelShape.from_hf_config(preset_for("smollm2-135m-instruct"), "x") == \
            ModelShape.from_hf_config(config, "x")


def test_qwen2_5_7b_plans_at_pp8_with_uneven_stages(capsys):
    """28 layers at PP=8 split only unevenly: refused naming the fields, then planned with 3 + 6x4 + 1."""
    recipe = RECIPES / "qwen2.5-7b_grpo.yaml"
    pp8 = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=8"]
    status = main(["plan", "--gpus", "16", str(recipe), *pp8])
    printed = capsys.readouterr()
    assert status != 0 and "cannot split the model's 28 layers" in printed.out + printed.err
    uneven = pp8 + ["parallel.num_layers_in_first_pipeline_stage=3", "parallel.num_layers_in_last_pipeline_stage=1"]
    status, out = _plan(capsys, recipe, 16, uneven, "--json")
    plan = json.loads(out)
    assert status == 0 and plan["fits"], out
    weights = [stage["actor_weights"] for stage in plan["stages"]]
    layer = weights[1] // 4  # bf16 bytes of one layer on one TP rank: the middle stages hold 4 each
    assert len(weights) == 8 and weights[1:7] == [4 * layer] * 6
    embedding = 152064 // 2 * 3584 * 2  # Qwen2.5-7B's vocab (TP-split) x hidden, bf16; its head is untied
    assert weights[0] == 3 * layer + embedding
    assert weights[7] == layer + 3584 * 2 + embedding  # 1 layer, the final norm and the LM head


def test_default_gpus_is_the_smallest_world_the_layout_takes(capsys):
    """Without --gpus the plan takes the fewest ranks the layout runs on: with experts split over more ranks
    than TP x PP x CP, a multiple of both (seen failing: the PP2 x EP8 recipe asked for 2 ranks)."""
    status = main(["plan", "--json", str(RECIPES / "qwen3-30b-a3b_grpo.yaml")])
    default = json.loads(capsys.readouterr().out)
    assert status == 0 and default["fits"]
    assert main(["plan", "--json", "--gpus", "16", str(RECIPES / "qwen3-30b-a3b_grpo.yaml")]) == 0
    assert json.loads(capsys.readouterr().out) == default
