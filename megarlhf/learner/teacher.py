"""The teacher of a distillation run (``teacher``): built in the trainer's layout or in one of its own
(``teacher.parallel``), and its scores of a batch's response tokens.

In a layout of its own the teacher's data-parallel replicas are not the student's: a teacher at TP2 over
the two ranks of a DP2 student is one replica that must score both student replicas' rows. So each student
replica is owned by one teacher replica (the lowest one holding a rank of it), which gathers the token ids,
lengths and response masks of the student replicas it owns (small) over its own ranks, scores them together,
and hands each its rows; every rank of a student replica then gets them from the same rank, so its TP, PP and
CP ranks compute with the same numbers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
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
    outputs = Outputs("logprobs", teacher.vocab_size, scoring_temperature(config.rollout),
                      top_k=config.algorithm.distill.top_k)
    if teacher.layout is None:
        return _score(teacher, outputs, batch.input_ids, batch.lengths, batch.response_mask, config)
    return _score_in_own_layout(teacher, outputs, batch, config)


FIELD_NAMES = {"logprobs": "teacher_logprobs", "topk_logprobs": "teacher_topk_logprobs",
               "topk_ids": "teacher_topk_ids", "topk_rest": "teacher_topk_rest"}  # the pass's -> the batch's


def _score(teacher: TrainModel, outputs: Outputs, input_ids: Tensor, lengths: Tensor, response_mask: Tensor,
           config: RunConfig) -> dict[str, Tensor]:
    mbs = micro_batches_for(input_ids, lengths, response_mask, config, teacher.runtime)
    out = forward_only(teacher.model, mbs, tuple(input_ids.shape), teacher.runtime, outputs)
    return {FIELD_NAMES[name]: value for name, value in out.items()}


def _score_in_own_layout(teacher: TrainModel, outputs: Outputs, batch: ExperienceBatch,
                         config: RunConfig) -> dict[str, Tensor]:
    """Each student replica's rows are scored once, by the teacher replica that owns them (the lowest-ranked
    one holding a rank of that student replica), and every rank of the student replica gets them from one rank
    of the owner: a student replica's TP/PP/CP ranks must all see the same numbers (their gradients must agree).
    A teacher replica gathers its owned replicas' token ids, lengths and masks over its own ranks only."""
    layout = teacher.layout
    student, own = layout.base, layout.runtime
    owners = _owners(layout.dp_ranks)
    mine = owners[student.dp.rank] == own.dp.rank
    sent = None  # only a rank in its replica's owner sends that replica's rows
    if mine:
        host = (batch.input_ids.cpu(), batch.lengths.cpu(), batch.response_mask.cpu())  # host: pickled to the peers
        sent = (student.dp.rank, host)
    replicas = dict(item for item in own.all_gather_objects(sent, over="replica") if item is not None)
    shape = tuple(batch.input_ids.shape)
    fields = None
    if replicas:  # the same on every rank of this teacher replica: it scores them together
        order = sorted(replicas)
        width = max(int(replicas[dp][0].shape[1]) for dp in order)
        ids = torch.cat([_pad_to(replicas[dp][0], width) for dp in order]).to(student.device)
        lengths = torch.cat([replicas[dp][1] for dp in order]).to(student.device)
        mask = torch.cat([_pad_to(replicas[dp][2], width) for dp in order]).to(student.device)
        with layout.active():
            scores = _score(teacher, outputs, ids, lengths, mask, config)
        if mine:
            start = sum(int(replicas[dp][0].shape[0]) for dp in order[:order.index(student.dp.rank)])
            fields = {name: value[start:start + shape[0], :shape[1]].clone() for name, value in scores.items()}
    return _from_the_owner(fields, outputs, shape, layout, owners)


def _owners(dp_ranks: list[tuple[int, int]]) -> dict[int, int]:
    """Student data-parallel rank -> the teacher replica that scores its rows."""
    owners: dict[int, int] = {}
    for student_dp, teacher_dp in dp_ranks:
        owners[student_dp] = min(teacher_dp, owners.get(student_dp, teacher_dp))
    return owners


def _source_rank(dp_ranks: list[tuple[int, int]], student_dp: int, owners: dict[int, int]) -> int:
    """The trainer rank student replica ``student_dp`` reads its scores from: its first rank in its owner."""
    return next(rank for rank, ranks in enumerate(dp_ranks) if ranks == (student_dp, owners[student_dp]))


def _from_the_owner(fields: dict[str, Tensor] | None, outputs: Outputs, shape: tuple[int, int], layout,
                    owners: dict[int, int]) -> dict[str, Tensor]:
    """Every rank of this student replica gets the fields of its first rank in the owning teacher replica."""
    student = layout.base
    source = _source_rank(layout.dp_ranks, student.dp.rank, owners)
    if student.replica.size == 1:
        return fields
    if fields is None or student.launch.rank != source:
        fields = {FIELD_NAMES[name]: torch.empty(size, dtype=dtype, device=student.device)
                  for name, (size, dtype) in outputs.fields(shape).items()}
    for name in sorted(fields):
        dist.broadcast(fields[name], src=source, group=student.replica.group)
    return fields


def _pad_to(values: Tensor, width: int) -> Tensor:
    """``values`` [B, W] right-padded with zeros (False) to ``width`` columns."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
