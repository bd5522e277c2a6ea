"""Two ranks: a teacher in a parallel layout of its own scores each student replica's rows as HF does.
Usage: _worker_teacher_layout.py STUDENT_TP MODEL_DIR OUT_DIR

The student's layout is TP ``STUDENT_TP`` (DP is what is left of the 2 ranks). With DP 2 each replica holds
every other row of the shared batch (so the two replicas' batches differ in rows and in width). For each
teacher layout of :data:`TEACHER_LAYOUTS` the teacher is built with :func:`build_teacher` and scores this
rank's rows with the top-k (gkd's fields); the reference is HF transformers on the same weights, fp32: the
full log_softmax at the scoring temperature, its top-k and the log-sum of the rest. Also records that the
run's Megatron groups are back after building and scoring (the student's log-probs before and after are
equal to the bit; its gloo data-parallel group, which the distributed optimizer holds, still works) and the
teacher's own runtime sizes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarlhf.config.distill import DistillConfig, TeacherConfig
from megarlhf.config.parallel import ParallelConfig
from megarlhf.testing.launch import write_rank_result
from parallel.runtime import init_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _batch import experience, run_config  # noqa: E402

TOP_K = 12
TEACHER_LAYOUTS = {  # per student TP: name -> the teacher's ParallelConfig (None: the student's layout)
    1: {"same": None, "tp2": ParallelConfig(tensor_model_parallel_size=2),
        "pp2": ParallelConfig(pipeline_model_parallel_size=2), "cp2": ParallelConfig(context_parallel_size=2)},
    2: {"dp2": ParallelConfig(), "pp2": ParallelConfig(pipeline_model_parallel_size=2)},
}


def hf_reference(model_dir: str, ids: torch.Tensor, temperature: float) -> dict[str, torch.Tensor]:
    """Token-aligned [B, L] (and [B, L, K]) teacher fields from HF's full logits (column 0 unused)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits.float() / temperature, dim=-1)[:, :-1]
    top, top_ids = logp.topk(TOP_K, dim=-1)
    rest = logp.scatter(-1, top_ids, float("-inf")).logsumexp(-1)
    shift = lambda t: torch.cat([torch.zeros_like(t[:, :1]), t], 1)  # noqa: E731 - token-aligned
    return {"teacher_logprobs": shift(logp.gather(-1, ids[:, 1:, None]).squeeze(-1)),
            "teacher_topk_logprobs": shift(top), "teacher_topk_ids": shift(top_ids), "teacher_topk_rest": shift(rest)}


def main() -> None:
    student_tp = int(sys.argv[1])
    model_dir, out_dir = sys.argv[2:4]
    runtime = init_parallel(ParallelConfig(tensor_model_parallel_size=student_tp))
    from megatron.core import parallel_state as ps

    from megarlhf.learner import build_frozen, compute_logprobs
    from megarlhf.learner.teacher import build_teacher, teacher_scores

    config = run_config(model_dir)
    config.algorithm.distill = DistillConfig(loss="gkd", top_k=TOP_K)
    batch = experience()
    local = batch.select(torch.arange(batch.batch_size)[runtime.dp.rank::runtime.dp.size])
    mask = local.response_mask
    expected = hf_reference(model_dir, local.input_ids, config.rollout.temperature)
    student = build_frozen(config, runtime, "reference")
    before = compute_logprobs(student, local, config)
    gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)  # the distributed optimizer's
    result = {"rank": dist.get_rank(), "width": int(local.input_ids.shape[1]), "layouts": {}}
    for name, layout in TEACHER_LAYOUTS[student_tp].items():
        config.teacher = TeacherConfig(model_path=model_dir, parallel=layout)
        teacher = build_teacher(config, runtime)
        scores = teacher_scores(teacher, local, config)
        own = teacher.runtime
        result["layouts"][name] = {
            "own_layout": teacher.layout is not None, "sizes": [own.tp.size, own.pp.size, own.cp.size, own.dp.size],
            "shapes_match": all(scores[k].shape == expected[k].shape for k in expected),
            "logprobs": float((scores["teacher_logprobs"] - expected["teacher_logprobs"])[mask].abs().max()),
            "topk_logprobs": float((scores["teacher_topk_logprobs"] - expected["teacher_topk_logprobs"])[mask]
                                   .abs().max()),
            "topk_ids_equal": bool((scores["teacher_topk_ids"] == expected["teacher_topk_ids"])[mask].all()),
            "rest": float((scores["teacher_topk_rest"] - expected["teacher_topk_rest"])[mask].abs().max()),
            "run_tp_after": ps.get_tensor_model_parallel_world_size(),
            "run_dp_after": ps.get_data_parallel_world_size(),
            # what the ranks of one student replica hold must be the same numbers
            "digest": [float(scores[k].double().sum()) for k in sorted(scores)],
        }
        del teacher
    result["student_unchanged"] = bool(torch.equal(before, compute_logprobs(student, local, config)))
    alive = torch.ones(1)
    dist.all_reduce(alive, group=gloo)  # raises if building a layout destroyed the run's gloo groups
    result["run_gloo_group"] = [dist.get_process_group_ranks(gloo), float(alive)]
    write_rank_result(out_dir, dist.get_rank(), result)


if __name__ == "__main__":
    main()
