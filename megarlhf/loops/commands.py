"""The trainer sub-commands of ``megarlhf``: ``train`` (RL), ``sft``, ``dpo``, ``rs``, ``online-dpo``, ``rm``,
``eval`` and ``export``.

Each takes a YAML recipe and ``key.sub=value`` overrides (see :mod:`megarlhf.config`) and runs the same
way single-process or under ``torchrun --nproc-per-node N -m megarlhf ...``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarlhf.core.errors import ConfigError


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (a RunConfig; see examples/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. optim.lr=1e-6")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--out", default=None, help="directory for the results (a new or empty one; default: "
                        "<logging.run_dir>/eval/<UTC time>): metrics.json, samples.jsonl, config.yaml")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a run directory (its recorded config is used) or the run's YAML recipe")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. parallel.tensor_model_parallel_size=2")
    parser.add_argument("--out", required=True, help="HF directory to write (a new or empty one)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out when it is an earlier export (never a directory megarlhf did not write)")


def _config(args: argparse.Namespace, needs_train_data: bool = False):
    from megarlhf.config import ConfigError, RunConfig, load_config
    from megarlhf.records.run_config import newest_record

    recipe, overrides = args.recipe, list(args.overrides)
    if Path(recipe).is_dir():  # a run directory: the config it recorded, found where the directory is now
        if args.command != "export":  # the record is redacted: a run needs the recipe that holds its secrets
            raise ConfigError(f"{recipe} is a directory: megarlhf {args.command} takes a YAML recipe (only "
                              "export takes a run directory)")
        record = newest_record(Path(recipe))
        if record is None:
            raise ConfigError(f"{recipe} is a directory without a recorded config.yaml: give the run's directory "
                              "(after its first step) or a YAML recipe")
        recipe, overrides = str(record), [f"logging.run_dir={recipe}", *overrides]
    config = load_config(RunConfig, recipe, overrides)
    if needs_train_data and not config.data.train_path:
        raise ConfigError(f"missing required config key(s): data.train_path (megarlhf {args.command} trains on it)")
    return config


def run_train(args: argparse.Namespace) -> int:
    from megarlhf.loops.rl import train_rl

    train_rl(_config(args, needs_train_data=True))
    return 0


def run_sft(args: argparse.Namespace) -> int:
    from megarlhf.loops.sft import train_sft

    train_sft(_config(args, needs_train_data=True))
    return 0


def run_dpo(args: argparse.Namespace) -> int:
    from megarlhf.loops.preference import train_dpo

    train_dpo(_config(args, needs_train_data=True))
    return 0


def run_rs(args: argparse.Namespace) -> int:
    from megarlhf.loops.iterative import train_iterative

    train_iterative(_config(args, needs_train_data=True), "rs")
    return 0


def run_online_dpo(args: argparse.Namespace) -> int:
    from megarlhf.loops.iterative import train_iterative

    train_iterative(_config(args, needs_train_data=True), "online-dpo")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    from megarlhf.loops.preference import train_rm

    train_rm(_config(args, needs_train_data=True))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Evaluates ``model.path`` on ``data.eval_path``, prints the metrics as one JSON line and keeps them, with
    every sample (prompt, response, reward), in its own directory (:func:`eval_output_dir`): an evaluation
    never writes into the run directory's own records."""
    from megarlhf.core.console import set_log_dir
    from megarlhf.learner import build_frozen
    from megarlhf.loops.evaluate import eval_output_dir, evaluate, write_eval_results
    from megarlhf.records.sample_log import SampleLog
    from megarlhf.rewards import CombinedReward
    from megarlhf.rollout.phase import build_rollout_phase, serve_engine_rank
    from megarlhf.run.context import start_run

    config = _config(args)
    if not config.data.eval_path:
        raise ConfigError("megarlhf eval needs data.eval_path (the held-out prompts)")
    if config.eval_reward is None:
        raise ConfigError("megarlhf eval needs a verifier: reward.functions is empty, set eval.reward_functions")
    out = eval_output_dir(config, args.out)
    set_log_dir(out / "logs")
    run = start_run(config, "eval")
    if run.is_engine_rank:
        serve_engine_rank(config, run.runtime)
        return 0
    prompts = run.load_prompts(config.data.eval_path, config.eval_reward)
    run.actor = build_frozen(config, run.runtime, "policy")  # the engine is synced from it and verified
    run.eval_reward = CombinedReward(config.eval_reward)  # held-out accuracy is the task's, never a learned proxy's
    run.rollout = build_rollout_phase(config, run.actor, [], run.tokenizer)
    run.samples = SampleLog(out, run.tokenizer, per_step=len(prompts) * config.eval.n_samples, runtime=run.runtime)
    metrics = evaluate(run, prompts.examples, 0)
    run.eval_reward.close()
    run.rollout.close()
    if run.is_main:
        write_eval_results(config, out, metrics)
        print(json.dumps(metrics), flush=True)
        print(f"wrote {out / 'metrics.json'} and {out / 'samples.jsonl'}", flush=True)
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Writes the actor of a run checkpoint (``checkpoint.resume``: auto = the latest) as an HF directory
    (with LoRA: merged, and its PEFT adapter at ``<out>-adapter``)."""
    from megarlhf.algorithms.advantages import estimator_needs
    from megarlhf.core.outputs import check_replaceable
    from megarlhf.learner import build_actor, build_critic, export_policy
    from megarlhf.learner.models import adapter_dir
    from megarlhf.run.checkpointer import RunCheckpointer
    from megarlhf.run.context import start_run

    config = _config(args)
    out = Path(args.out).absolute()
    for target in [out] + ([adapter_dir(out)] if config.model.lora is not None else []):
        check_replaceable(target, args.overwrite, "--out" if target == out else "the adapter directory")
    run = start_run(config, "export")
    run.actor = build_actor(config, run.runtime)
    if estimator_needs(config.algorithm.estimator).critic:  # a PPO run's checkpoint holds its critic, loaded whole
        run.critic = build_critic(config, run.runtime)
    if RunCheckpointer(config, run.trained_models()).resume() is None:
        raise FileNotFoundError(f"no checkpoint to export (checkpoint.resume={config.checkpoint.resume!r}, "
                                f"run_dir={config.logging.run_dir!r})")
    out = export_policy(run.actor, config, out, overwrite=args.overwrite)  # LoRA: merged, the adapter beside
    run.log(f"exported to {out}")
    return 0
