"""Per-rank memory of a run: what each model, the activations and the rollout engine hold, per phase.

The command decides which models a run keeps (:func:`workload`, read from the recipe as the trainer
reads it): ``train`` (RL) the actor, a reference when the algorithm uses one, a critic for GAE, a teacher
(``teacher``, distillation), a learned reward model and the engine; ``rs`` the actor, the engine and a learned reward; ``online-dpo`` also the
reference when the loss needs one and ``iterative.reference=fixed``; ``sft`` the actor; ``dpo`` the actor and
the reference its loss needs (with ``preference.precompute_reference`` it is dropped after scoring the
dataset, but both are resident while it scores); ``rm`` a value-head model. Commands without an engine
plan sequences of ``data.max_sequence_length`` tokens and have no sync or generate phase (0 below). A
micro-batch of a command that trains on pairs (``dpo`` with a paired loss, ``rm``, ``online-dpo``) holds
both sides of a pair: at least twice the longest sequence.

:func:`plan_memory` turns a :class:`RunConfig`, a model shape and the launch (world size, device memory)
into a :class:`MemoryPlan`: one :class:`StagePlan` per pipeline stage (every rank of a stage holds the
same bytes: TP splits evenly, DP and CP replicate), each with its components and the three phases of
the colocate schedule:

* ``train``     (steps 7-9) actor + reference + critic + teacher resident; the engine asleep (GPU: vLLM sleep level
                1 frees its weights and KV cache) -- on CPU vLLM cannot sleep, so it stays resident;
* ``sync``      (step 3) the actor's parameters still resident (grads, optimizer and the other models are
                offloaded first), the engine's weights awake, one weight-sync bucket in flight;
* ``generate``  (step 4) the engine's weights and KV cache; the trainer state is offloaded to host memory;
* ``judge``     (step 6, with ``reward.judge`` only) the trainer state back on the device and the judge's engine
                awake (weights and KV cache; it sleeps, on the host, the rest of the step).

What is counted, per rank (d = bytes of ``model.dtype``; P = this rank's parameters, see
:meth:`ModelShape.params_per_rank`; S = optimizer shards = DP x CP with the distributed optimizer, else 1):

* weights ``P * d``; gradients ``P * 4`` (Megatron DDP reduces gradients in fp32: ``grad_reduce_in_fp32``);
* optimizer: Adam's two moments in fp32 plus an fp32 master copy when the weights are bf16,
  ``P * (8 + 4 [bf16]) / S``;
* activations of one micro-batch of ``T = max(train.micro_batch_tokens, longest sequence) / CP`` tokens,
  times the micro-batches in flight on the stage (1F1B: ``PP - stage``). Per token and layer
  (t = TP, q = heads x head_dim / t, g = KV heads x head_dim / t, F = FFN size):
  ``d * (2h + 3q + 3g + 4 head_dim + 5F/t) + 4 * (4h + q + heads/t)``. These are the tensors autograd
  saves in Megatron-Core's local layer spec with megarlhf's packed attention: each of the two RMSNorms
  keeps its fp32 upcast input and normalised input and its output; the QKV output, roped q and k, the
  attention's fp32 output and log-sum-exp and the output projection's input; fc1's 2F output and three
  F-wide SwiGLU tensors; RoPE's cos/sin. They were counted exactly on CPU (tests/planner) in fp32 and
  bf16. With ``train.recompute`` (Megatron's full recomputation) a checkpointed chunk of layers keeps
  only its input (``d * h`` per token), plus one chunk's activations while it is recomputed: ``uniform``
  checkpoints every chunk of ``num_layers`` layers, ``block`` the first ``num_layers`` layers one by
  one (the others store everything). ``activations_recompute`` is the figure for full recomputation
  of every layer, shown for comparison. The final norm keeps ``8h`` bytes per token, and the fused
  log-prob op holds a transient ``[T, min(4096, V/t)]`` fp32 chunk (x3; x6 for GKD, whose update also takes
  the log-probs at the teacher's top-k and of the rest of the vocabulary: measured 5.4 on CPU);
* mixture of experts: an MoE layer holds its router, ``num_experts / EP`` routed experts split over TP and
  a shared expert; the routed experts' optimizer state is sharded over the expert-data-parallel ranks
  (``world / (TP x EP x PP)``), the rest over DP x CP. Per token, an MoE layer's MLP keeps, instead of the
  dense ``5F/t``: for each of its ``k`` routed copies the dispatched input, the all-to-all buffer and the
  expert output (``3h``) and fc1's output and SwiGLU (``5F_e/t``), plus ``5F_s/t + 1`` for a shared expert
  at the activation dtype, and ``2E + k`` fp32 router logits, scores and combine weights, assuming
  balanced routing (the dispatcher receives ``k`` copies per token on average). On a CPU run of a tiny
  Qwen3-MoE at EP2 the saved activations were within 0.4% of this and the trainer phase within 0.6%
  (tests/planner/test_measured.py);
* LoRA (``model.lora``): the weights are the frozen base plus the adapters; gradients and optimizer
  state exist for the adapters (and a critic's value head) only; the reference is the actor's base
  (no weights of its own). The adapters' rank-r activations (r elements per token per adapted layer)
  are not counted;
* a learned reward (``reward.reward_model_path``): its frozen weights with the value head, ``P_rm * d``
  (its own config.json gives P_rm);
* a teacher (``teacher``): its frozen weights in the trainer's layout or its own (``teacher.parallel``: its
  heaviest stage), ``P_teacher * d_teacher``
  (``teacher.dtype``; its own config.json gives P_teacher), offloaded with the trainer state; and its scores
  of the step's rows at the full sequence length: a [rows, L] fp32 log-prob field and, for a top-k loss
  (GKD), [rows, L, top_k] fp32 log-probs and int64 ids and the [rows, L] rest. In its own layout a teacher
  replica scores the rows of up to min(student DP, its TP x PP x CP) student replicas at once, and each rank
  keeps a copy of its own;
* engine: the HF weights ``/ rollout.tensor_parallel_size`` and ``rollout.kv_cache_mb`` of KV cache;
  a sync bucket is ``max(rollout.weight_sync.bucket_mb, the largest HF tensor)``;
* an LLM judge (``reward.judge``): one TP-1 engine per rank, its weights at ``judge.dtype`` (its own
  config.json gives their count) and ``judge.kv_cache_mb``.

Not counted (the ``reserve``, a per-rank allowance the caller chooses): CUDA context, NCCL buffers,
allocator fragmentation, vLLM's own activation and sampler workspace, and on CPU the Python/torch runtime.

No library plans Megatron training and a colocated engine together.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarlhf.core.dtypes import dtype_bytes
from megarlhf.config.schema import RunConfig
from megarlhf.core.errors import ConfigError, UserError
from megarlhf.planner.shapes import ModelShape, resolve_shape
from megarlhf.algorithms.advantages import estimator_needs
from megarlhf.algorithms.preference_losses import PREFERENCE_LOSSES
from megarlhf.algorithms.distillation import distills_into

GIB = 2**30
MIB = 2**20
LOGPROB_CHUNK = 4096  # megarlhf.ops' default vocabulary chunk
PHASES = ("train", "sync", "generate", "judge")
COMMANDS = ("train", "sft", "dpo", "rm", "rs", "online-dpo")


@dataclass(frozen=True)
class Workload:
    """The models a command keeps on the devices (see the module docstring)."""

    engine: bool
    reference: bool
    critic: bool
    reward_model: bool
    head: str  # the trained model's head: "lm" (a policy) or "value" (a reward model)
    rows_together: int = 1  # rows one micro-batch must hold whole: 2 for preference pairs
    teacher: bool = False  # a frozen teacher the student learns from (algorithm.distill)


def workload(config: RunConfig, command: str) -> Workload:
    learned_reward = config.reward.reward_model_path is not None
    loss = PREFERENCE_LOSSES.get(config.preference.loss)
    if command == "train":
        critic = estimator_needs(config.algorithm.estimator).critic
        return Workload(True, config.algorithm.uses_reference, critic, learned_reward, "lm",
                        teacher=config.teacher is not None)
    if command == "online-dpo":
        reference = loss.needs_reference and config.iterative.reference == "fixed"
        return Workload(True, reference, False, learned_reward, "lm", rows_together=2)
    if command == "rs":
        return Workload(True, False, False, learned_reward, "lm")
    if command == "dpo":
        return Workload(False, loss.needs_reference, False, False, "lm", rows_together=2 if loss.paired else 1)
    if command == "rm":
        return Workload(False, False, False, False, "value", rows_together=2)
    return Workload(False, False, False, False, "lm")


@dataclass(frozen=True)
class Launch:
    """What the recipe does not say: how many ranks, how much memory each has, what is set aside."""

    world_size: int
    device_memory_gib: float = 80.0
    device: str = "gpu"  # "gpu" (vLLM sleeps; offload frees device memory) or "cpu" (everything stays)
    reserve_gib: float = 3.0
    command: str = "train"  # the megarlhf command that runs the recipe: one of COMMANDS

    def __post_init__(self):
        if self.command not in COMMANDS:
            raise UserError(f"--command must be one of {', '.join(COMMANDS)}, got {self.command!r}")
        if self.world_size < 1:
            raise UserError(f"--gpus must be >= 1, got {self.world_size}")
        if self.device not in ("gpu", "cpu"):
            raise UserError(f"--device must be 'gpu' or 'cpu', got {self.device!r}")
        if self.device_memory_gib <= 0 or self.reserve_gib < 0:
            raise UserError(f"--gpu-mem-gib must be > 0 and --reserve-gib >= 0, got "
                            f"{self.device_memory_gib}, {self.reserve_gib}")


@dataclass
class StagePlan:
    """The bytes of every rank of one pipeline stage."""

    stage: int
    components: dict[str, int]
    phases: dict[str, int]
    activations_recompute: int  # the activations term with full recomputation of every layer

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclass
class MemoryPlan:
    shape: ModelShape
    launch: Launch
    data_parallel_size: int
    stages: list[StagePlan]
    kv_tokens: int  # tokens the KV cache holds
    max_model_len: int
    sequences_per_engine: int  # sequences each engine generates per step
    host_offload: int  # bytes per rank moved to host memory during generation (GPU)
    notes: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return int((self.launch.device_memory_gib - self.launch.reserve_gib) * GIB)

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)

    def problems(self) -> list[str]:
        """Why this plan cannot run (empty when it fits)."""
        found = []
        worst = max(self.stages, key=lambda s: s.peak)
        if worst.peak > self.capacity:
            found.append(f"stage {worst.stage} needs {worst.peak / GIB:.2f} GiB in its {worst.peak_phase} phase, "
                         f"more than the {self.capacity / GIB:.2f} GiB available per rank "
                         f"({self.launch.device_memory_gib:g} GiB - {self.launch.reserve_gib:g} GiB reserve)")
        if self.sequences_per_engine and self.kv_tokens < self.max_model_len:  # 0: the command runs no engine
            found.append(f"the KV cache holds {self.kv_tokens} tokens, less than one sequence of max_model_len="
                         f"{self.max_model_len} (data.max_prompt_length + rollout.max_new_tokens): vLLM refuses "
                         f"to start")
        return found

    @property
    def fits(self) -> bool:
        return not self.problems()


def activation_elements_per_token_layer(shape: ModelShape, tp: int, moe: bool = False) -> tuple[int, int]:
    """(elements at the activation dtype, fp32 elements) autograd saves per token per layer (``moe``: of an
    MoE layer; see the module docstring)."""
    h, hd = shape.hidden_size, shape.head_dim
    q, g = shape.num_heads * hd // tp, shape.num_kv_heads * hd // tp
    attention, fp32 = 2 * h + 3 * q + 3 * g + 4 * hd, 4 * h + q + shape.num_heads // tp
    if not moe:
        return attention + 5 * shape.ffn_size // tp, fp32
    shared = 5 * shape.shared_expert_size // tp + 1 if shape.shared_expert_size else 0
    k = shape.top_k
    return attention + k * (3 * h + 5 * shape.expert_ffn_size // tp) + shared, fp32 + 2 * shape.num_experts + k


def _recomputed(recompute, layers: int, in_flight: int, per_layer: int, layer_input: int) -> int:
    """Activation bytes of one stage's layers under ``train.recompute`` (Megatron's full recomputation):
    a checkpointed chunk keeps only its input; in backward the chunks are recomputed last to first, so
    the peak is reached when the last chunk is recomputed while every chunk input is still held (the
    recomputed chunk's own input is the stored one, not a copy)."""
    if recompute.granularity == "none":
        return in_flight * layers * per_layer
    n = min(recompute.num_layers, layers)
    if recompute.method == "uniform":  # every chunk of n layers checkpointed
        return in_flight * -(-layers // n) * layer_input + n * per_layer - layer_input
    # block: the first n layers checkpointed one by one, the others stored; by the time the
    # checkpointed layers are recomputed, the stored layers' activations have been freed
    stored = in_flight * (n * layer_input + (layers - n) * per_layer)
    return max(stored, in_flight * n * layer_input + per_layer - layer_input)


def _activations(shape: ModelShape, config: RunConfig, stage: int, d: int, max_model_len: int,
                 head: str) -> tuple[int, int]:
    """(activation bytes as configured, with full recomputation of every layer) of one rank of ``stage``
    during a training step."""
    par = config.parallel
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    tokens = -(-max(config.train.micro_batch_tokens, max_model_len) // cp)
    dense, moe = shape.stage_moe_layers(tp, pp, stage, **par.uneven_stages)
    layers = dense + moe
    in_flight = pp - stage
    per_kind = [activation_elements_per_token_layer(shape, tp, kind) for kind in (False, True)]
    bytes_per_token = [elems * d + fp32_elems * 4 for elems, fp32_elems in per_kind]
    per_layer = tokens * -(-(dense * bytes_per_token[0] + moe * bytes_per_token[1]) // layers)  # the stage's mean
    if cp > 1:  # the all-gathered K and V of the whole sequence
        per_layer += tokens * 2 * (cp - 1) * shape.num_kv_heads * shape.head_dim // tp * d
    head_bytes = 0
    if stage == pp - 1:
        vocab_chunk = 1 if head == "value" else min(LOGPROB_CHUNK, shape.padded_vocab(tp) // tp)
        gkd = distills_into(config, "loss") is not None and distills_into(config, "loss").needs.top_k
        head_bytes = tokens * (8 * shape.hidden_size + (6 if gkd else 3) * vocab_chunk * 4)
    layer_input = tokens * shape.hidden_size * d
    configured = _recomputed(config.train.recompute, layers, in_flight, per_layer, layer_input) + head_bytes
    recompute_all = in_flight * layers * layer_input + per_layer - layer_input + head_bytes
    return configured, recompute_all


def _trainable(shape: ModelShape, config: RunConfig, stage: int, d: int, shards: int, head: str,
               expert_shards: int = 1) -> dict[str, int]:
    """Weights, gradients and optimizer state of a trained model; with LoRA only the adapters (and a value
    head) have gradients and optimizer state, and the weights are the frozen base plus the adapters. The
    routed experts' optimizer state is sharded over ``expert_shards`` (expert-DP) ranks, the rest over
    ``shards``."""
    par, lora = config.parallel, config.model.lora
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    params = shape.params_per_rank(tp, pp, stage, head, ep, **par.uneven_stages)
    experts = shape.expert_params_per_rank(tp, pp, stage, ep, **par.uneven_stages)
    trained = params
    if lora is not None:
        adapters = (shape.check_layout(tp, pp, **par.uneven_stages)[stage]
                    * shape.lora_layer_params(lora.rank, lora.targets, tp, lora.canonical))
        value_head = shape.hidden_size if head == "value" and stage == par.pipeline_model_parallel_size - 1 else 0
        params, trained = params + adapters, adapters + value_head
    master = 4 if d < 4 else 0  # bf16 weights get an fp32 master copy; fp32 weights are their own
    distributed = config.optim.use_distributed_optimizer
    optim_shards, optim_expert_shards = (shards, expert_shards) if distributed else (1, 1)
    experts = experts if lora is None else 0  # LoRA: the experts are frozen (and refused by the trainer)
    optimizer = (trained - experts) * (8 + master) // optim_shards + experts * (8 + master) // optim_expert_shards
    return {"weights": params * d, "grads": trained * 4, "optimizer": optimizer}


def _reward_model_shape(config: RunConfig, actor: ModelShape) -> ModelShape | None:
    """The learned reward model's shape (its own config.json; the actor's when that is not readable here)."""
    path = config.reward.reward_model_path
    if path is None:
        return None
    try:
        return resolve_shape(path)[0]
    except ValueError:
        return actor


def _teacher_weights(config: RunConfig, stage: int, world_size: int) -> int:
    """The teacher's weights on each rank of the trainer's pipeline stage ``stage``: in the trainer's layout,
    that stage's share; in a layout of its own (``teacher.parallel``), its heaviest stage's (a rank of any
    trainer stage may hold any teacher stage)."""
    try:
        shape, _ = resolve_shape(config.teacher.model_path)
    except UserError:
        raise UserError(f"teacher.model_path={config.teacher.model_path!r} has no config.json and its name matches "
                        f"no preset: the planner cannot count the teacher's weights") from None
    par = config.teacher.parallel or config.parallel
    ep = par.expert_model_parallel_size if shape.num_experts else 1
    if config.teacher.parallel is not None:
        try:
            par.validate(world_size)
            shape.check_layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                               par.expert_model_parallel_size, **par.uneven_stages)
        except ValueError as err:
            raise ConfigError(f"teacher.parallel ({config.teacher.model_path}): {err}") from None
    stages = [stage] if config.teacher.parallel is None else range(par.pipeline_model_parallel_size)
    params = max(shape.params_per_rank(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, s, "lm", ep,
                                       **par.uneven_stages) for s in stages)
    return params * dtype_bytes(config.teacher.dtype or config.model.dtype)


def _teacher_scores(config: RunConfig, dp: int, max_model_len: int) -> int:
    """The teacher's scores on a rank while the step trains (the module docstring)."""
    rows = config.train.global_batch_size * config.rollout.n_samples // dp
    own, top_k = config.teacher.parallel, config.algorithm.distill.top_k
    copies = 1 if own is None else min(dp, own.model_parallel_size) + 1
    per_token = 4 + (top_k * (4 + 8) + 4 if top_k else 0)
    return copies * rows * max_model_len * per_token


def _judge_engine(config: RunConfig) -> dict[str, int]:
    """The judge engine's weights and KV cache on each rank (0 without ``reward.judge``)."""
    judge = config.reward.judge
    if judge is None:
        return {"judge_weights": 0, "judge_kv_cache": 0}
    try:
        shape, _ = resolve_shape(judge.model_path)
    except UserError:
        raise UserError(f"reward.judge.model_path={judge.model_path!r} has no config.json and its name matches no "
                        f"preset: the planner cannot count the judge's weights") from None
    return {"judge_weights": shape.total_params() * dtype_bytes(judge.dtype or config.model.dtype),
            "judge_kv_cache": judge.kv_cache_mb * MIB}


def _stage(shape: ModelShape, config: RunConfig, launch: Launch, stage: int, dp: int, max_model_len: int,
           engine: dict[str, int]) -> StagePlan:
    d = dtype_bytes(config.model.dtype)
    shards = dp * config.parallel.context_parallel_size
    par = config.parallel
    work = workload(config, launch.command)
    expert_shards = launch.world_size // par.expert_layout_size
    comp = {f"actor_{k}": v for k, v in _trainable(shape, config, stage, d, shards, work.head, expert_shards).items()}
    separate_reference = work.reference and config.model.lora is None  # LoRA: the actor's base
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    comp["reference_weights"] = (shape.params_per_rank(tp, pp, stage, "lm", ep, **par.uneven_stages) * d
                                 if separate_reference else 0)
    reward_shape = _reward_model_shape(config, shape) if work.reward_model else None
    comp["reward_model_weights"] = (0 if reward_shape is None else reward_shape.params_per_rank(
        tp, pp, stage, "value", ep if reward_shape.num_experts else 1, **par.uneven_stages) * d)
    comp["teacher_weights"] = _teacher_weights(config, stage, launch.world_size) if work.teacher else 0
    comp["teacher_scores"] = _teacher_scores(config, dp, max_model_len) if work.teacher else 0
    critic = _trainable(shape, config, stage, d, shards, "value", expert_shards) if work.critic else {}
    comp.update({f"critic_{k}": critic.get(k, 0) for k in ("weights", "grads", "optimizer")})
    # a micro-batch holds at least one whole item: a sequence, or both sides of a preference pair
    act, act_recompute = _activations(shape, config, stage, d, max_model_len * work.rows_together, work.head)
    if work.critic:  # the critic trains after the actor: the larger of the two counts
        critic_act, critic_recompute = _activations(shape, config, stage, d, max_model_len, "value")
        act, act_recompute = max(act, critic_act), max(act_recompute, critic_recompute)
    comp["activations"] = act
    comp.update(engine)
    trainer_state = sum(v for k, v in comp.items()  # what is offloaded while the engines generate
                        if k.startswith(("actor_", "reference_", "critic_", "reward_model_", "teacher_"))
                        and k != "teacher_scores")
    act += comp["teacher_scores"]  # like the activations, they exist while the step trains only
    if not work.engine:  # nothing is offloaded, nothing generates
        phases = {"train": trainer_state + act, "sync": 0, "generate": 0, "judge": 0}
    elif launch.device == "cpu":  # no vLLM sleep mode, and offload copies into the same (host) memory
        everything = trainer_state + act + sum(engine.values())
        phases = {"train": everything, "sync": everything, "generate": everything,
                  "judge": everything if engine["judge_weights"] else 0}
    else:
        phases = {
            "train": trainer_state + act,
            "sync": comp["actor_weights"] + engine["engine_weights"] + engine["engine_sync_bucket"],
            "generate": engine["engine_weights"] + engine["engine_kv_cache"],
            "judge": (trainer_state + engine["judge_weights"] + engine["judge_kv_cache"]) if engine["judge_weights"]
                     else 0,
        }
    return StagePlan(stage, comp, phases, act_recompute)


def plan_memory(config: RunConfig, shape: ModelShape, launch: Launch) -> MemoryPlan:
    """The per-rank memory plan of ``config`` on ``launch.world_size`` ranks (raises on a bad layout)."""
    par = config.parallel
    par.validate(launch.world_size)
    shape.check_layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                       par.expert_model_parallel_size, **par.uneven_stages)
    if shape.num_experts and par.tensor_model_parallel_size > 1:
        raise ConfigError(f"tensor_model_parallel_size={par.tensor_model_parallel_size}: the planner plans "
                          f"mixture-of-experts models at TP 1 only (at TP > 1 they train with sequence "
                          f"parallelism, whose activation split it does not model yet); split the experts with "
                          f"parallel.expert_model_parallel_size")
    dp = par.data_parallel_size(launch.world_size)
    if config.train.global_batch_size % dp:
        raise ConfigError(f"train.global_batch_size={config.train.global_batch_size} is not divisible by the "
                          f"data-parallel size {dp} ({launch.world_size} ranks / TP x PP x CP "
                          f"{par.model_parallel_size})")
    engine_tp = config.rollout.tensor_parallel_size
    if engine_tp not in (1, launch.world_size):
        raise ConfigError(f"rollout.tensor_parallel_size={engine_tp}: must be 1 (one engine per rank) or the "
                          f"world size {launch.world_size}")
    d = dtype_bytes(config.model.dtype)
    with_engine = workload(config, launch.command).engine
    if with_engine:
        max_model_len = config.data.max_prompt_length + config.rollout.response_budget
        engine = {"engine_weights": shape.total_params() * d // engine_tp,
                  "engine_kv_cache": config.rollout.kv_cache_mb * MIB,
                  "engine_sync_bucket": max(config.rollout.weight_sync.bucket_mb * MIB, shape.largest_tensor() * d),
                  **_judge_engine(config)}  # a judge scores the samples of commands with an engine only
    else:
        max_model_len = config.data.max_sequence_length
        engine = {"engine_weights": 0, "engine_kv_cache": 0, "engine_sync_bucket": 0, "judge_weights": 0,
                  "judge_kv_cache": 0}
    stages = [_stage(shape, config, launch, s, dp, max_model_len, engine) for s in range(par.pipeline_model_parallel_size)]
    kv_tokens = config.rollout.kv_cache_mb * MIB // (shape.kv_elements_per_token() * d // engine_tp)
    prompts_per_rank = -(-config.train.global_batch_size // dp // par.model_parallel_size)
    per_engine = (config.train.global_batch_size if engine_tp > 1 else prompts_per_rank) * config.rollout.n_samples
    if not with_engine:
        kv_tokens = per_engine = 0
    # during generation: the trainer state, and a judge's weights (asleep on the host all but the judge phase)
    host = (max(s.phases["train"] - s.components["activations"] - s.components["teacher_scores"]
                + s.components["judge_weights"] for s in stages)
            if launch.device == "gpu" and with_engine else 0)
    plan = MemoryPlan(shape, launch, dp, stages, kv_tokens, max_model_len, per_engine, host_offload=host)
    if with_engine and max_model_len <= kv_tokens < per_engine * max_model_len:
        plan.notes.append(f"the KV cache holds {kv_tokens // max_model_len} full-length sequences of the "
                          f"{per_engine} each engine generates per step: vLLM queues the rest (slower rollouts, "
                          f"not an error)")
    return plan
