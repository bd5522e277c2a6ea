"""One run's context, and how every run starts.

:func:`start_run` checks the config against the registries, initialises torch.distributed and Megatron's
groups for ``config.parallel`` and loads the tokenizer of ``model.path``, so that a bad key or path fails
before any model is built; a training run also checks that its export directory ``<run_dir>/hf`` may be
written. The run's record ``config.yaml`` is written later, once the run has started
(:meth:`RunContext.resume`: models built, checkpoint loaded), so a failed start leaves it alone. The
:class:`RunContext` it returns then carries what the run builds (models, rewards, engines, checkpointer,
recorder): a loop passes it instead of a dozen loose objects, and each function reads the settings it uses
from ``run.config``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megarlhf.config import to_dict
from megarlhf.config.reward import RewardConfig
from megarlhf.config.schema import RunConfig
from megarlhf.core import startup
from megarlhf.core.console import set_log_dir
from megarlhf.core.errors import CheckpointError, ConfigError, DataError
from megarlhf.core.hub import looks_like_hub_name
from megarlhf.core.outputs import check_replaceable
from megarlhf.data.prompts import PromptDataset, load_prompt_dataset
from megarlhf.data.sampler import PromptSampler
from megarlhf.envs.prompting import tool_describer
from megarlhf.learner import TrainModel, export_policy
from megarlhf.learner.models import adapter_dir
from megarlhf.learner.step import prefix_sharing_notice
from megarlhf.records.metrics import MetricsRecorder, plot_curves
from megarlhf.records.run_config import record_run_config
from megarlhf.records.sample_log import SampleLog
from megarlhf.records.tracking import open_trackers
from megarlhf.rewards import CombinedReward
from megarlhf.run.checkpointer import RunCheckpointer
from megarlhf.run.checks import check_config, check_ground_truths, check_teacher
from parallel.runtime import Runtime, init_disaggregated, init_parallel, read_launch_env


@dataclass
class RunContext:
    """What one run has. :func:`start_run` fills the first four; the loop adds the rest as it builds them
    (None where the run has none)."""

    config: RunConfig
    runtime: Runtime
    run_dir: Path
    tokenizer: object
    command: str  # the megarlhf command running (its checkpoints are of this kind)
    resumed: dict | None = None  # the driver state of the checkpoint resume() loaded
    actor: TrainModel | None = None  # the trained model: the policy (a value-head model for ``megarlhf rm``)
    reference: TrainModel | None = None
    critic: TrainModel | None = None
    teacher: TrainModel | None = None  # the frozen model algorithm.distill learns from
    reward_model: TrainModel | None = None  # a learned reward (reward.reward_model_path)
    reward: CombinedReward | None = None
    eval_reward: CombinedReward | None = None
    rollout: object | None = None  # the engines: megarlhf.rollout.phase's RolloutPhase or DisaggregatedPhase
    checkpointer: RunCheckpointer | None = None
    recorder: MetricsRecorder | None = None  # metrics.jsonl, the console and the trackers
    samples: SampleLog | None = None

    @property
    def is_engine_rank(self) -> bool:
        """Disaggregated placement: this rank only serves a rollout engine."""
        return self.runtime.is_engine_rank

    @property
    def is_main(self) -> bool:
        return self.runtime.launch.rank == 0

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends a response: the tokenizer's end of sequence (the engines add the model's own)."""
        return (self.tokenizer.eos_token_id,)

    def trained_models(self) -> dict[str, TrainModel]:
        """The models a checkpoint holds: the actor and, when there is one, the critic."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def log(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def resume(self, num_examples: int) -> tuple[PromptSampler, int]:
        """This rank's seeded sampler over ``num_examples`` and the first step to run, both restored from
        the checkpoint ``checkpoint.resume`` names (the run's checkpointer restores the models in place);
        the checkpoint's whole driver state is left in ``self.resumed`` (None: a fresh start). The run has
        started: its config is recorded (:func:`record_run_config`)."""
        config = self.config
        sampler = PromptSampler(num_examples, config.train.global_batch_size, config.seed, config.data.shuffle,
                                self.runtime.dp.rank, self.runtime.dp.size)
        resumed = self.resumed = self.checkpointer.resume()
        first_step = 0 if resumed is None else resumed["step"]
        if resumed is not None:
            sampler.load_state_dict(resumed["sampler"])
            self.log(f"resumed from step {first_step}")
        if self.is_main:
            difference = record_run_config(self.config, self.run_dir, first_step)
            if difference:
                self.log(difference)
        return sampler, first_step

    def open_recorder(self, first_step: int, **options) -> MetricsRecorder:
        """Opens the run's metrics recorder from ``first_step`` on (0: a fresh start) for ``train.steps``
        steps, with the trackers ``logging.backends`` names opened on global rank 0 (a resumed run continues
        their runs)."""
        startup.mark("set_up")  # since the last mark: models (or checkpointer, resume) not marked on their own
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
        self.recorder = MetricsRecorder(self.run_dir, total_steps=self.config.train.steps, trackers=trackers,
                                        rank=self.runtime.launch.rank, resume_after_step=first_step - 1,
                                        log_every=settings.log_every, **options)
        startup.mark("trackers")
        return self.recorder

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Records ``step``'s metrics (:class:`MetricsRecorder`) with the trainer ranks' resident memory:
        ``memory/rss_gb_max`` (the largest rank's), ``memory/rss_gb_mean``, ``memory/rss_gb_rank0``.
        Collective over the trainer ranks."""
        metrics = {**startup.report(), **metrics}  # the first step's record also says where start-up went
        resident = self.runtime.all_gather_objects(resident_gb(), over="trainers")
        memory = {"memory/rss_gb_max": max(resident), "memory/rss_gb_mean": sum(resident) / len(resident),
                  "memory/rss_gb_rank0": resident[0]}
        self.recorder.log(step, {**metrics, **memory})

    def save(self, completed_steps: int, state: Callable[[], dict]) -> None:
        """A checkpoint after ``completed_steps`` steps when ``checkpoint.every`` (or the end) says so, holding
        the driver's ``state()`` (asked for only then: taking it can be collective)."""
        if self.checkpointer.should_save(completed_steps, self.config.train.steps):
            self.checkpointer.save(completed_steps, {"step": completed_steps, **state()})

    def close(self) -> None:
        """Closes the recorder and what the run opened (rewards, engines: engine ranks stop serving), before
        the export, so that a failing export leaves nothing waiting."""
        self.recorder.close()
        for thing in (self.reward, self.eval_reward, self.rollout):
            if thing is not None:
                thing.close()

    def finish(self, out: Path, curve_keys: tuple[str, ...], what: str = "trained policy") -> None:
        """After the export of the trained model (``what``) to ``out``: the curves of ``curve_keys``."""
        if self.is_main:
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", keys=curve_keys)
        self.log(f"exported the {what} to {out}")

    def finish_policy_run(self, curve_keys: tuple[str, ...] = ("reward/mean", "eval/accuracy")) -> Path:
        """The end of a run that trains a policy: :meth:`close`, the actor exported to ``<run_dir>/hf``,
        :meth:`finish`; returns the export directory."""
        self.close()
        out = export_policy(self.actor, self.config, self.run_dir / "hf")
        self.finish(out, curve_keys)
        return out

    def train_and_eval_prompts(self) -> tuple[PromptDataset, PromptDataset | None]:
        """The prompts of ``data.train_path`` and of ``data.eval_path`` (None when unset)."""
        config = self.config
        distill = config.algorithm.distill
        responses = distill is not None and distill.lmbda < 1  # some steps train on the dataset's responses
        train = self.load_prompts(config.data.train_path, config.reward,
                                  response_budget=config.rollout.response_budget if responses else None)
        return train, (self.load_prompts(config.data.eval_path, config.eval_reward) if config.data.eval_path else None)

    def load_prompts(self, path: str, rewards: RewardConfig | None, response_budget: int | None = None
                     ) -> PromptDataset:
        """The prompts at ``path`` (and, with ``response_budget``, their dataset responses), refused when
        ``rewards`` score against answers some of them lack."""
        env = self.config.rollout.env
        describe = None if env is None else tool_describer(env, self.tokenizer)
        dataset = load_prompt_dataset(path, self.tokenizer, self.config.data, describe, response_budget)
        if len(dataset) == 0:
            raise DataError(f"{path}: no prompt is left after dropping {dataset.num_dropped} longer than "
                            f"data.max_prompt_length={self.config.data.max_prompt_length}")
        check_ground_truths(dataset, rewards, self.config.data.answer_key)
        return dataset


def resident_gb() -> float:
    """This process's resident memory in GiB (the engine runs in it; worker processes are not counted)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        hint = (" it looks like a Hugging Face hub name, but megarlhf reads local directories only: download it "
                "(huggingface-cli download NAME --local-dir DIR) or, for the models it knows, megarlhf fetch"
                if looks_like_hub_name(model_path) else "")
        raise FileNotFoundError(f"model.path={model_path!r} is not an HF model directory (no config.json there);"
                                f"{hint}".rstrip(";"))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # e.g. no tokenizer files: transformers' message, one line
        raise CheckpointError(f"model.path={model_path!r}: cannot load its tokenizer "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


READ_ONLY_COMMANDS = ("eval", "export")  # they read logging.run_dir and write elsewhere


def check_export_targets(config: RunConfig, run_dir: Path) -> None:
    """Refuses, before any work, a run whose final export would have to replace a directory megarlhf did
    not write (``<run_dir>/hf``, and with LoRA its adapter beside it)."""
    targets = [run_dir / "hf"] + ([adapter_dir(run_dir / "hf")] if config.model.lora is not None else [])
    for target in targets:
        check_replaceable(target.absolute(), overwrite=True, what="the run's export directory")


def start_run(config: RunConfig, command: str) -> RunContext:
    """Initialises the ranks for ``config`` and returns the run's context. ``command``: the megarlhf command
    (``train``, ``sft``, ...); all but ``eval`` and ``export``, which only read ``logging.run_dir``, train
    and export into it.

    With the disaggregated placement, Megatron's groups cover the trainer ranks only and the last
    ``rollout.placement.num_engine_ranks`` ranks are engine ranks (no Megatron state, no data).
    """
    startup.begin()
    startup.mark("launch_and_imports")
    check_config(config)
    tokenizer = load_tokenizer(config.model.path)
    placement, world = config.rollout.placement, read_launch_env().world_size
    trainer_ranks = placement.num_trainer_ranks(world) if placement.mode == "disaggregated" else world
    if config.teacher is not None and command not in READ_ONLY_COMMANDS:  # eval / export read train recipes too
        if command != "train":
            raise ConfigError(f"teacher (with algorithm.distill) is read by megarlhf train only, not by megarlhf "
                              f"{command}: remove it from the recipe")
        check_teacher(config, tokenizer, trainer_ranks)
    startup.mark("config_and_tokenizer")
    if placement.mode == "disaggregated":
        runtime = init_disaggregated(config.parallel, trainer_ranks, seed=config.seed)
    else:
        placement.validate(world)
        runtime = init_parallel(config.parallel, seed=config.seed)
    startup.mark("process_groups")
    run_dir = Path(config.logging.run_dir)
    if command not in READ_ONLY_COMMANDS:
        check_export_targets(config, run_dir)
        if runtime.launch.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        set_log_dir(run_dir / "logs")  # tracebacks of errors inside megarlhf
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = RunContext(config=config, runtime=runtime, run_dir=run_dir, tokenizer=tokenizer, command=command)
    notice = None if runtime.is_engine_rank else prefix_sharing_notice(config, runtime)
    if notice:
        run.log(notice)
    return run
