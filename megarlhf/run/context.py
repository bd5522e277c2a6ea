"""What every trainer does first: start the ranks, prepare the run directory, load tokenizer and data.

:func:`start_run` initialises torch.distributed and Megatron's groups for ``config.parallel``, writes the
resolved config to ``<run_dir>/config.yaml`` (rank 0), and loads the tokenizer of ``model.path`` and the
datasets, so that a bad path or a malformed row fails before any model is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from megarlhf.config import save_config, to_dict
from megarlhf.config.schema import RunConfig
from megarlhf.run.checks import check_config
from megarlhf.data.prompts import PromptDataset, load_prompt_dataset
from megarlhf.data.sampler import PromptSampler
from megarlhf.envs.prompting import tool_describer
from megarlhf.core.errors import CheckpointError, ConfigError, DataError
from megarlhf.records.metrics import MetricsRecorder, plot_curves
from megarlhf.records.tracking import open_trackers
from megarlhf.learner import export_policy
from megarlhf.learner.step import prefix_sharing_notice
from parallel.runtime import Runtime, init_disaggregated, init_parallel, read_launch_env


@dataclass
class RunContext:
    config: RunConfig
    runtime: Runtime
    run_dir: Path
    tokenizer: object
    resumed: dict | None = None  # the driver state of the checkpoint resume() loaded

    @property
    def is_engine_rank(self) -> bool:
        """Disaggregated placement: this rank only serves a rollout engine."""
        return self.runtime.is_engine_rank

    @property
    def dp_rank(self) -> int:
        return self.runtime.dp.rank

    @property
    def dp_size(self) -> int:
        return self.runtime.dp.size

    @property
    def is_main(self) -> bool:
        return self.runtime.launch.rank == 0

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def log(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def resume(self, checkpointer, num_examples: int) -> tuple[PromptSampler, int]:
        """This rank's seeded sampler over ``num_examples`` and the first step to run, both restored from
        the checkpoint ``checkpoint.resume`` names (models are restored in place by the checkpointer);
        the checkpoint's whole driver state is left in ``self.resumed`` (None: a fresh start)."""
        config = self.config
        sampler = PromptSampler(num_examples, config.train.global_batch_size, config.seed, config.data.shuffle,
                                self.dp_rank, self.dp_size)
        resumed = self.resumed = checkpointer.resume()
        if resumed is None:
            return sampler, 0
        sampler.load_state_dict(resumed["sampler"])
        self.log(f"resumed from step {resumed['step']}")
        return sampler, resumed["step"]

    def open_recorder(self, total_steps: int, first_step: int, **options) -> MetricsRecorder:
        """The run's metrics recorder from ``first_step`` on (0: a fresh start), with the trackers
        ``logging.backends`` names opened on global rank 0 (a resumed run continues their runs)."""
        settings, trackers, error = self.config.logging, [], None
        if self.is_main:
            try:
                trackers = open_trackers(settings, self.run_dir, to_dict(self.config), first_step - 1)
            except Exception as err:  # noqa: BLE001 - shared below, then raised on every rank
                error = err
        failure = self.runtime.all_gather_objects(None if error is None else str(error), over="trainers")[0]
        if error is not None:
            raise error
        if failure is not None:  # the other ranks stop with rank 0's message instead of waiting for it
            raise ConfigError(f"rank 0 could not open the run's trackers: {failure}")
        return MetricsRecorder(self.run_dir, total_steps=total_steps, trackers=trackers,
                               rank=self.runtime.launch.rank, resume_after_step=first_step - 1,
                               log_every=settings.log_every, **options)

    def finish_policy_run(self, recorder: MetricsRecorder, closables: list, actor,
                          curve_keys: tuple[str, ...] = ("reward/mean", "eval/accuracy")) -> Path:
        """The end of a run that trains a policy on rollouts: closes the recorder and ``closables`` (rewards,
        the rollout phase; None entries skipped), exports the actor to ``<run_dir>/hf`` and draws the curves
        of ``curve_keys``; returns the export directory."""
        recorder.close()
        for thing in closables:
            if thing is not None:
                thing.close()
        export_dir = export_policy(actor, self.config, self.run_dir / "hf")
        if self.is_main:
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", keys=curve_keys)
        self.log(f"exported the trained policy to {export_dir}")
        return export_dir

    def train_and_eval_prompts(self) -> tuple[PromptDataset, PromptDataset | None]:
        """The prompts of ``data.train_path`` and of ``data.eval_path`` (None when unset)."""
        data = self.config.data
        return self.load_prompts(data.train_path), (self.load_prompts(data.eval_path) if data.eval_path else None)

    def load_prompts(self, path: str) -> PromptDataset:
        env = self.config.rollout.env
        describe = None if env is None else tool_describer(env, self.tokenizer)
        dataset = load_prompt_dataset(path, self.tokenizer, self.config.data, describe)
        if len(dataset) == 0:
            raise DataError(f"{path}: no prompt is left after dropping {dataset.num_dropped} longer than "
                            f"data.max_prompt_length={self.config.data.max_prompt_length}")
        if dataset.num_dropped:
            self.log(f"{path}: dropped {dataset.num_dropped} prompts longer than data.max_prompt_length")
        return dataset


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={model_path!r} is not an HF model directory (no config.json there)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # e.g. no tokenizer files: transformers' message, one line
        raise CheckpointError(f"model.path={model_path!r}: cannot load its tokenizer "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def start_run(config: RunConfig) -> RunContext:
    """Initialises the ranks for ``config`` and returns the run's context.

    With the disaggregated placement, Megatron's groups cover the trainer ranks only and the last
    ``rollout.placement.num_engine_ranks`` ranks are engine ranks (no Megatron state, no data).
    """
    check_config(config)
    tokenizer = load_tokenizer(config.model.path)
    placement, world = config.rollout.placement, read_launch_env().world_size
    if placement.mode == "disaggregated":
        runtime = init_disaggregated(config.parallel, placement.num_trainer_ranks(world), seed=config.seed)
    else:
        placement.validate(world)
        runtime = init_parallel(config.parallel, seed=config.seed)
    run_dir = Path(config.logging.run_dir)
    if runtime.launch.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.yaml")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = RunContext(config=config, runtime=runtime, run_dir=run_dir, tokenizer=tokenizer)
    notice = None if runtime.is_engine_rank else prefix_sharing_notice(config, runtime)
    if notice:
        run.log(notice)
    return run
