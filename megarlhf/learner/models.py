"""Actor, critic and reference models of a run, built from a ``RunConfig``.

* actor: the causal LM from ``model.path`` wrapped in Megatron's ``DistributedDataParallel``, with
  ``get_megatron_optimizer`` (Adam with decoupled weight decay; plain or distributed optimizer from
  ``optim.use_distributed_optimizer``; gradient clipping at ``optim.clip_grad``) and Megatron's
  ``OptimizerParamScheduler`` (linear warmup from 0 over ``optim.warmup_steps`` optimizer steps, then
  constant / cosine / linear decay to ``optim.min_lr`` over the run's optimizer steps).
* critic: the value-head model from ``model.critic_path`` (or ``model.path``), same machinery, its own
  learning rate (``optim.critic_lr``, default the actor's).
* reference (and the evaluated policy of ``megarlhf eval``): the causal LM from ``model.path``, eval
  mode, no gradients, no DDP, no optimizer (:func:`build_frozen`); with LoRA the reference is the
  actor's own frozen base with its adapters off (:func:`build_reference`): no second copy of the weights.
* teacher (``teacher``): a frozen causal LM from ``teacher.model_path`` at ``teacher.dtype``, built like the
  reference (:func:`frozen_causal_lm`) in the run's parallel layout or its own (:mod:`megarlhf.learner.teacher`).
* LoRA (``model.lora``): actor and critic get adapters on their linear layers after loading
  (:func:`parallel.lora.attach_lora`), which freezes the base weights before DDP and the optimizer see
  them, so gradients, DDP buffers and optimizer state exist for adapters (and a critic's value head) only.
* reward model: a value-head model scoring whole sequences, trained by ``megarlhf rm`` or frozen in RL
  (:func:`build_reward_model`).

Trained models recompute activations as ``train.recompute`` says (Megatron's own full recomputation).
Every model is built for packed sequences (``packed_sequences=True``) with ``variable_seq_lengths=True``
(micro-batches differ in length, so pipeline stages exchange shapes); the trainable ones get
``finalize_model_grads_func`` (DP all-reduce, PP embedding sync) and DDP's ``no_sync``. DDP averages
gradients over the data-parallel x context-parallel group (``calculate_per_token_loss=False``): the
loss shares of :mod:`megarlhf.learner.step` are scaled for exactly that.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megarlhf.core.dtypes import torch_dtype
from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError
from megarlhf.config.parallel import LayoutError
from parallel.runtime import Runtime


@dataclass
class TrainModel:
    """A model of the run: Megatron stage (DDP-wrapped when trainable), provider, optimizer, scheduler,
    and the runtime it lives in (device and groups)."""

    role: str  # "actor", "critic", "reference", "policy" (a frozen evaluated policy), "teacher" or "reward_model"
    model: torch.nn.Module
    provider: Any  # model_providers.base.ModelProvider
    runtime: Runtime
    optimizer: Any = None  # Megatron optimizer (None for the reference)
    scheduler: Any = None  # Megatron OptimizerParamScheduler (None for the reference)
    shares_actor: bool = False  # a view of the actor's parameters (the LoRA reference): never offloaded apart
    router_stats: Any = None  # megarlhf.learner.moe_metrics.RouterStats of a trainable MoE model (else None)
    # megarlhf.learner.routing_replay.RoutingReplay of an MoE actor with algorithm.routing_replay set (else None)
    routing_replay: Any = None
    # a model in a parallel layout of its own (parallel.layouts.OwnLayout; a teacher's): it is built and runs
    # inside layout.active(), and ``runtime`` is that layout's (None: the run's layout)
    layout: Any = None
    # an actor's: the policy version of its weights, the number of RL steps whose updates they hold (set by the
    # loop at resume and after each update; the rollout phase stamps every sampled token with the version it synced)
    policy_version: int = 0

    @property
    def kind(self) -> str:
        """What its forward produces: per-token values (critic), a score per sequence (reward model) or
        per-token log-probs (every causal LM)."""
        return {"critic": "values", "reward_model": "scores"}.get(self.role, "logprobs")

    @property
    def vocab_size(self) -> int:
        return int(self.provider.hf_config.vocab_size)

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None


def params_dtype(config: RunConfig) -> torch.dtype:
    return torch_dtype(config.model.dtype, "model.dtype")


def rl_optimizer_steps(config: RunConfig) -> int:
    """Optimizer steps of a whole RL run: steps x mini-batches x epochs (the lr schedule's length)."""
    return config.train.steps * config.train.updates_per_step


_FROZEN_OVERRIDES = dict(packed_sequences=True)  # a frozen model keeps no activations for backward


def _model_overrides(config: RunConfig, trainable: bool = True) -> dict:
    """Every model is built for packed micro-batches; trained ones recompute activations as
    ``train.recompute`` says (a frozen model keeps no activations for backward), and get LoRA adapters'
    unfused norms (:func:`model_providers.base.build_layer_spec`) when ``model.lora`` is set, and the router
    losses of ``model.moe`` (an MoE model's; a dense one refuses them)."""
    if not trainable:
        return dict(_FROZEN_OVERRIDES)
    return dict(packed_sequences=True, unfused_norms=config.model.lora is not None,
                **config.train.recompute.transformer_config_fields(), **config.model.moe.transformer_config_fields())


def _variable_lengths(model):
    """Micro-batches differ in length: pipeline stages exchange shapes. Set after construction because
    TransformerConfig's validation rejects the flag with the (unused, dense-model) MoE dispatcher default."""
    model.config.variable_seq_lengths = True
    return model


def _distributed_optimizer_layout(model, ddp_config, runtime: Runtime):
    """The distributed optimizer's buffer layout, which Megatron-Core 0.19 asks DDP's callers to compute
    (DDP computes the same itself, with a warning, when not given one): the trainable parameters in
    DDP's order, one bucket (``overlap_grad_reduce`` is off), padded for the DP x CP group and, for
    expert parameters, the expert-DP group, as DDP's own fallback does. None without that optimizer."""
    if not ddp_config.use_distributed_optimizer:
        return None
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert not ddp_config.overlap_grad_reduce, "overlapped reduction buckets the buffers: pass its bucket size"
    # one distributed-optimizer instance: Megatron's partial DP groups are the whole DP x CP / expert-DP groups
    return DistributedOptimizer.compute_full_param_layout(
        [p for p in model.parameters() if p.requires_grad], None, runtime.dp_cp.size, ddp_config,
        expert_data_parallel_world_size=runtime.edp.size)


def _refuse_untrainable_moe(role: str, provider, config: RunConfig, runtime: Runtime) -> None:
    """Layouts in which an MoE model builds but cannot be trained correctly (a dense model passes)."""
    if not provider.is_moe:
        return
    if runtime.tp.size > 1 and config.model.moe.enabled:
        # measured: under sequence parallelism Megatron's per-TP-rank router losses give other values and
        # gradients than at TP 1 (tests/learner/test_moe_step.py)
        raise LayoutError(f"model.moe router losses (aux_loss_coeff={config.model.moe.aux_loss_coeff}, "
                          f"z_loss_coeff={config.model.moe.z_loss_coeff}) with tensor_model_parallel_size="
                          f"{runtime.tp.size} are not supported yet (the MoE layers run sequence-parallel there); "
                          f"train them at TP 1 with parallel.expert_model_parallel_size, or switch the losses off")
    dense_only = provider.dense_only_stages(config.parallel)
    if dense_only:
        raise LayoutError(f"pipeline stage(s) {dense_only} would hold only dense layers of the trained "
                          f"mixture-of-experts {role}; every stage needs an MoE layer: change "
                          f"parallel.pipeline_model_parallel_size or the uneven stage sizes")


def _wrap_trainable(role: str, model, provider, config: RunConfig, runtime: Runtime, lr: float,
                    total_steps: int, load: Callable[[], None] | None = None) -> TrainModel:
    """DDP, optimizer and lr schedule around ``model``; ``load`` (if given) writes its weights once DDP holds
    its parameters, before the optimizer copies any (bf16 main params)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim, dtype = config.optim, params_dtype(config)
    _refuse_untrainable_moe(role, provider, config, runtime)
    tconfig = model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=optim.use_distributed_optimizer)
    ddp = DistributedDataParallel(tconfig, ddp_config, model,
                                  full_param_layout=_distributed_optimizer_layout(model, ddp_config, runtime))
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    if load is not None:
        load()
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min(optim.min_lr, lr), weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps, clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=optim.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    decay_steps = max(total_steps, optim.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else lr, max_lr=lr, min_lr=min(optim.min_lr, lr),
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=optim.schedule,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)  # a resume keeps its step count, not its lr
    from megarlhf.learner.moe_metrics import RouterStats

    return TrainModel(role, ddp, provider, runtime, optimizer, scheduler,
                      router_stats=RouterStats.attach(model, provider, runtime.device))


def build_actor(config: RunConfig, runtime: Runtime, total_steps: int | None = None) -> TrainModel:
    """The actor from ``model.path``; ``total_steps``: optimizer steps of the lr schedule (default
    :func:`rl_optimizer_steps`). Megatron's parallel state must be initialised."""
    from model_providers.hf_checkpoint import build_hf_model, load_hf_weights
    from parallel.lora import adapter_parameter_names

    provider, model = build_hf_model(config.model.path, params_dtype(config), **_model_overrides(config))
    _variable_lengths(model)
    adapter = config.model.lora.adapter_path if config.model.lora is not None else None
    _attach_lora(model, config, runtime, start_from=(provider, adapter) if adapter is not None else None)
    steps = rl_optimizer_steps(config) if total_steps is None else total_steps
    # read where DDP holds the parameters: with the distributed optimizer DDP copies each into its buffer, so a
    # load before it wrote every parameter twice (0.5 GB more memory touched per rank for SmolLM2)
    load = functools.partial(load_hf_weights, model, provider, config.model.path,
                             allow_unmapped=adapter_parameter_names(model))
    actor = _wrap_trainable("actor", model, provider, config, runtime, config.optim.lr, steps, load=load)
    return dataclasses.replace(actor, routing_replay=_routing_replay(model, provider, config, runtime))


def _routing_replay(model, provider, config: RunConfig, runtime: Runtime):
    from megarlhf.learner.routing_replay import RoutingReplay

    mode = config.algorithm.routing_replay
    if mode != "none" and not provider.is_moe:
        raise ConfigError(f"algorithm.routing_replay={mode!r} replays the routing of a mixture-of-experts model; "
                          f"{config.model.path} ({provider.model_type}) is dense: set it to 'none'")
    return RoutingReplay.attach(model, provider, mode, runtime)


def build_critic(config: RunConfig, runtime: Runtime, total_steps: int | None = None) -> TrainModel:
    """The critic (value head) from ``model.critic_path`` or ``model.path``, with ``optim.critic_lr``."""
    from model_providers.value_head import load_value_model

    path = config.model.critic_path or config.model.path
    provider, model = load_value_model(path, params_dtype(config), **_model_overrides(config))
    _variable_lengths(model)
    _attach_lora(model, config, runtime, trainable=("output_layer.weight",))  # the value head is new: it trains
    lr = config.optim.critic_lr or config.optim.lr
    steps = rl_optimizer_steps(config) if total_steps is None else total_steps
    return _wrap_trainable("critic", model, provider, config, runtime, lr, steps)


def _attach_lora(model, config: RunConfig, runtime: Runtime, trainable: tuple[str, ...] = (),
                 start_from: tuple | None = None) -> None:
    """LoRA adapters on ``model`` per ``model.lora``; ``start_from``: (provider, PEFT adapter directory) the
    adapters are loaded from (the actor's ``model.lora.adapter_path``)."""
    from parallel.lora import attach_lora

    lora = config.model.lora
    if lora is None:
        return
    count = attach_lora(model, lora, seed=config.seed, trainable=trainable)
    if start_from is not None:
        from model_providers.peft_adapter import load_peft_adapter

        load_peft_adapter(model, start_from[0], lora, start_from[1])
    if runtime.launch.rank == 0:
        params = list(model.parameters())
        train = sum(p.numel() for p in params if p.requires_grad)
        layout = "canonical, " if lora.canonical else ""
        source = f"; loaded from {start_from[1]}" if start_from is not None else ""
        print(f"LoRA: {count} adapters ({layout}rank {lora.rank}, alpha {lora.alpha:g}) on {', '.join(lora.targets)}"
              f"{source}; {train:,} of {sum(p.numel() for p in params):,} parameters of this rank train", flush=True)


def build_reference(config: RunConfig, runtime: Runtime, actor: TrainModel) -> TrainModel:
    """The reference policy: with LoRA the actor's frozen base (its adapters off, the same parameters:
    ``shares_actor``), otherwise a frozen copy of ``model.path`` (:func:`build_frozen`)."""
    from parallel.lora import AdaptersOff

    if config.model.lora is None:
        return build_frozen(config, runtime, "reference")
    return TrainModel("reference", AdaptersOff(actor.model), actor.provider, runtime, shares_actor=True)


def build_frozen(config: RunConfig, runtime: Runtime, role: str) -> TrainModel:
    """A frozen causal LM from ``model.path`` in the run's layout: the ``"reference"`` policy of the KL term
    or the ``"policy"`` that ``megarlhf eval`` evaluates (a teacher: :func:`megarlhf.learner.teacher.
    build_teacher`)."""
    if role not in ("reference", "policy"):
        raise ValueError(f"build_frozen: role must be 'reference' or 'policy', got {role!r}")
    return TrainModel(role, *frozen_causal_lm(config.model.path, params_dtype(config)), runtime)


def frozen_causal_lm(path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(model, provider) of the HF causal LM at ``path`` in Megatron's current layout: eval mode,
    ``requires_grad=False``, built for packed micro-batches."""
    from model_providers.hf_checkpoint import load_hf_model

    provider, model = load_hf_model(path, dtype, **_FROZEN_OVERRIDES)
    _variable_lengths(model)
    model.eval()
    model.requires_grad_(False)
    return model, provider


def build_reward_model(config: RunConfig, runtime: Runtime, path: str, total_steps: int | None = None,
                       trainable: bool = True) -> TrainModel:
    """A value-head reward model from ``path``: trainable (``megarlhf rm``: a causal LM gets a fresh head,
    an HF ``...ForSequenceClassification`` keeps its ``score.weight``), or frozen for scoring in RL, which
    requires a trained head (a causal LM without ``score.weight`` is refused, naming the path)."""
    from model_providers.hf_checkpoint import HFCheckpoint
    from model_providers.value_head import HF_SCORE, load_value_model

    if not trainable and HF_SCORE not in HFCheckpoint(path):
        raise ConfigError(f"reward model {path}: no {HF_SCORE} (a causal LM without a reward head); train one "
                          f"with `megarlhf rm` or give an HF ...ForSequenceClassification directory")
    provider, model = load_value_model(path, params_dtype(config), **_model_overrides(config, trainable))
    _variable_lengths(model)
    if trainable:
        _attach_lora(model, config, runtime, trainable=("output_layer.weight",))
        steps = rl_optimizer_steps(config) if total_steps is None else total_steps
        return _wrap_trainable("reward_model", model, provider, config, runtime, config.optim.lr, steps)
    model.eval()
    model.requires_grad_(False)
    return TrainModel("reward_model", model, provider, runtime)


def adapter_dir(out) -> Path:
    """Where the PEFT adapter of a LoRA run's HF export ``out`` goes: ``<out>-adapter`` beside it."""
    out = Path(out)
    return out.parent / f"{out.name}-adapter"


def export_policy(trained: TrainModel, config: RunConfig, out, overwrite: bool = True) -> Path:
    """Exports a trained causal LM as an HF directory at ``out`` (with LoRA: adapters merged into the
    weights) and, with LoRA, its adapters as a PEFT directory at :func:`adapter_dir` ``(out)``. An existing
    directory is replaced only with ``overwrite`` and only when megarlhf wrote it. Collective over all
    ranks; returns ``out``."""
    from model_providers.hf_checkpoint import export_hf_checkpoint
    from model_providers.peft_adapter import export_peft_adapter

    exported = export_hf_checkpoint(trained.model, trained.provider, out, source_dir=config.model.path,
                                    overwrite=overwrite)
    if config.model.lora is not None:
        export_peft_adapter(trained.model, trained.provider, config.model.lora, adapter_dir(out),
                            base_model=str(config.model.path), overwrite=overwrite)
    return exported
