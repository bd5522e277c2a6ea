"""The teacher of a distillation run (``teacher``): built in the trainer's layout or in one of its own
(``teacher.parallel``), and its scores of a batch's response tokens.

In a layout of its own the teacher's data-parallel replicas are not the student's: a teacher at TP2 over
the two ranks of a DP2 student is one replica that must score both student replicas' rows. So each teacher
replica gathers the batches of the student replicas its ranks belong to (token ids, lengths and response
masks: small), scores them together, and every rank keeps the rows of its own student replica.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megarlhf.config.rollout import scoring_temperature
from megarlhf.config.schema import RunConfig
from megarlhf.core.dtypes import torch_dtype
from megarlhf.learner.batch import ExperienceBatch
from megarlhf.learner.forward import Outputs, forward_only
from megarlhf.learner.models import TrainModel, frozen_causal_lm
from megarlhf.learner.step import micro_batches_for
from parallel.layouts import OwnLayout
from parallel.runtime import Runtime, current_layout


def build_teacher(config: RunConfig, runtime: Runtime) -> TrainModel:
    """The frozen teacher from ``teacher.model_path`` at ``teacher.dtype`` (default ``model.dtype``), in the
    run's layout, or in ``teacher.parallel``'s over the trainer ranks when that differs from the run's.
    Collective over the trainer ranks."""
    teacher = config.teacher
    dtype = torch_dtype(teacher.dtype or config.model.dtype, "teacher.dtype")
    if teacher.parallel is None or teacher.parallel == current_layout():
        return TrainModel("teacher", *frozen_causal_lm(teacher.model_path, dtype), runtime)
    layout = OwnLayout(teacher.parallel, runtime, "teacher.parallel")
    with layout.active() as own:
        model, provider = frozen_causal_lm(teacher.model_path, dtype)
    if runtime.launch.rank == 0:
        print(f"teacher: a layout of its own over the {runtime.trainers.size} trainer ranks: TP {own.tp.size}, "
              f"PP {own.pp.size}, CP {own.cp.size}, DP {own.dp.size}", flush=True)
    return TrainModel("teacher", model, provider, own, layout=layout)


def teacher_scores(teacher: TrainModel, batch: ExperienceBatch, config: RunConfig) -> dict[str, Tensor]:
    """The batch fields a teacher gives: its log-probs of the response tokens (``teacher_logprobs``) and, with
    ``algorithm.distill.top_k``, the top-k of its distribution at each of them (``teacher_topk_logprobs``,
    ``teacher_topk_ids``, ``teacher_topk_rest``), at the rollout's scoring temperature, as the student's are
    taken. Collective over the trainer ranks."""
    if teacher.layout is None:
        return _score(teacher, batch.input_ids, batch.lengths, batch.response_mask, config)
    rows, joint = _replica_rows(batch, teacher.layout)
    with teacher.layout.active():
        scores = _score(teacher, *joint, config)
    width = batch.input_ids.shape[1]
    return {name: value[rows, :width] for name, value in scores.items()}


def _score(teacher: TrainModel, input_ids: Tensor, lengths: Tensor, response_mask: Tensor,
           config: RunConfig) -> dict[str, Tensor]:
    top_k = config.algorithm.distill.top_k
    mbs = micro_batches_for(input_ids, lengths, response_mask, config, teacher.runtime)
    out = forward_only(teacher.model, mbs, tuple(input_ids.shape), teacher.runtime,
                       Outputs("logprobs", teacher.vocab_size, scoring_temperature(config.rollout), top_k=top_k))
    fields = {"teacher_logprobs": out["logprobs"]}
    if top_k:
        fields.update(teacher_topk_logprobs=out["topk_logprobs"], teacher_topk_ids=out["topk_ids"],
                      teacher_topk_rest=out["topk_rest"])
    return fields


def _replica_rows(batch: ExperienceBatch, layout: OwnLayout) -> tuple[slice, tuple[Tensor, Tensor, Tensor]]:
    """The rows this teacher replica scores (the batches of the student replicas of its ranks, in student
    data-parallel order, right-padded to the widest) and where this rank's own rows sit among them."""
    student, own = layout.base, layout.runtime
    host = (batch.input_ids.cpu(), batch.lengths.cpu(), batch.response_mask.cpu())  # host: pickled to the peers
    everyone = own.all_gather_objects((student.dp.rank, own.dp.rank, host), over="trainers")
    replicas = {}  # student data-parallel rank -> its batch, for the student replicas of this teacher replica
    for student_dp, teacher_dp, tensors in everyone:
        if teacher_dp == own.dp.rank:
            replicas.setdefault(student_dp, tensors)
    order = sorted(replicas)
    start = sum(int(replicas[dp][0].shape[0]) for dp in order[:order.index(student.dp.rank)])
    rows = slice(start, start + int(batch.input_ids.shape[0]))
    width = max(int(replicas[dp][0].shape[1]) for dp in order)
    ids = torch.cat([_pad_to(replicas[dp][0], width) for dp in order]).to(batch.input_ids.device)
    lengths = torch.cat([replicas[dp][1] for dp in order]).to(batch.lengths.device)
    mask = torch.cat([_pad_to(replicas[dp][2], width) for dp in order]).to(batch.response_mask.device)
    return rows, (ids, lengths, mask)


def _pad_to(values: Tensor, width: int) -> Tensor:
    """``values`` [B, W] right-padded with zeros (False) to ``width`` columns."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
