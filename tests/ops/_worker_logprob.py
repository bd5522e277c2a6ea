"""torchrun worker: every case of _logprob_reference for one backend, at TP=1 (full weight, no group)
and at TP=world (this rank's vocab shard, the world group as TP group); writes max |diff| against
the naive reference on the full, unsharded weight.

Usage: _worker_logprob.py OUT_DIR BACKEND   (BACKEND torch|triton; triton on CPU needs
TRITON_INTERPRET=1 and runs with small tiles so that rows, vocab tiles and vocab splits all have
ragged tails).
"""
import sys

import torch
import torch.distributed as dist

from _logprob_reference import CASES, make_case, naive_logprob_entropy, outputs_and_grads
from megarlhf.ops import LogprobOptions, logprob_entropy
from megarlhf.testing.launch import write_rank_result
from parallel.runtime import init_distributed, shutdown


def max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def op(backend: str, targets, mask, group, temperature: float, chunk: int, entropy: bool = True,
       rest_from: int | None = None):
    if backend == "triton":
        from megarlhf.ops.triton_logprob import triton_logprob_entropy
        from megarlhf.ops.triton_logprob import TritonBlocks

        options = LogprobOptions(tp_group=group, temperature=temperature, compute_entropy=entropy)
        blocks = TritonBlocks(block_n=32, block_v=64, block_h=32, target_programs=4)
        return lambda h, w: triton_logprob_entropy(h, w, targets, mask, options, blocks)
    options = LogprobOptions(tp_group=group, temperature=temperature, chunk_size=chunk, backend=backend,
                             compute_entropy=entropy, rest_from=rest_from)
    return lambda h, w: logprob_entropy(h, w, targets, mask, options)


def main(out_dir: str, backend: str) -> None:
    env = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    result = {}
    # the torch op also takes K targets per row (a distillation loss's log-probs of a teacher's top-k)
    # and the log-probability outside targets[:, 1:] as one more column (rest_from)
    cases = [(name, None, None) for name in CASES]
    if backend == "torch":
        cases += [(name, 3, None) for name in CASES] + [(name, 3, 1) for name in CASES]
    for name, targets_per_row, rest_from in cases:
        hidden, weight, targets, mask, ra, rb, chunk, temperature = make_case(name, targets_per_row=targets_per_row)
        if targets_per_row is not None:
            name = f"{name}[K={targets_per_row},rest_from={rest_from}]"
        if rest_from is not None:  # the rest column's gradient weight
            ra = torch.cat([ra, torch.randn(len(ra), 1, generator=torch.Generator().manual_seed(9))], dim=1)
        ref = outputs_and_grads(lambda h, w: naive_logprob_entropy(h, w, targets, mask, temperature, rest_from),
                                hidden, weight, ra, rb)
        tp1 = outputs_and_grads(op(backend, targets, mask, None, temperature, chunk, True, rest_from),
                                hidden, weight, ra, rb)
        result[f"{name}/tp1"] = {"logprob": max_diff(tp1[0], ref[0]),
                                 "entropy": max_diff(tp1[1], ref[1]),
                                 "grad_hidden": max_diff(tp1[2], ref[2]),
                                 "grad_weight": max_diff(tp1[3], ref[3])}
        if name.startswith("temperature"):   # log-probs only: no entropy term in forward or backward
            no_ent = outputs_and_grads(op(backend, targets, mask, None, temperature, chunk, False, rest_from),
                                       hidden, weight, ra, rb)
            ref_lp = outputs_and_grads(lambda h, w: (naive_logprob_entropy(
                h, w, targets, mask, temperature, rest_from)[0], None), hidden, weight, ra, rb)
            result[f"{name}/tp1_logprob_only"] = {
                "logprob": max_diff(no_ent[0], ref_lp[0]),
                "entropy": float(no_ent[1] is not None),   # 1.0 fails the check: none expected
                "grad_hidden": max_diff(no_ent[2], ref_lp[2]),
                "grad_weight": max_diff(no_ent[3], ref_lp[3])}
        v_local = weight.shape[0] // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        group = dist.group.WORLD if world > 1 else None
        lp, ent, gh, gw = outputs_and_grads(op(backend, targets, mask, group, temperature, chunk, True, rest_from),
                                            hidden, weight[shard], ra, rb)
        gathered = [gh]
        if world > 1:
            gathered = [torch.empty_like(gh) for _ in range(world)]
            dist.all_gather(gathered, gh)
        result[f"{name}/tp{world}"] = {
            "logprob": max_diff(lp, ref[0]), "entropy": max_diff(ent, ref[1]),
            "grad_hidden": max_diff(gh, ref[2]), "grad_weight": max_diff(gw, ref[3][shard]),
            "grad_hidden_same_on_ranks": all(torch.equal(g, gh) for g in gathered),
            "masked_outputs_zero": mask is None or bool((lp[~mask] == 0).all()
                                                        and (ent[~mask] == 0).all()),
            "masked_grads_zero": mask is None or bool((gh[~mask] == 0).all()),
        }
    if backend == "torch":
        result.update(topk_results(world, rank))
    write_rank_result(out_dir, env.rank, result)
    shutdown()


def topk_results(world: int, rank: int) -> dict:
    """The teacher's top-k op on this rank's vocab shard against the naive op on the full weight."""
    from _logprob_reference import naive_topk
    from megarlhf.ops import topk_logprobs

    result = {}
    group = dist.group.WORLD if world > 1 else None
    for name in CASES:
        hidden, weight, targets, mask, _, _, chunk, temperature = make_case(name)
        v_local = weight.shape[0] // world
        options = LogprobOptions(tp_group=group, temperature=temperature, chunk_size=chunk)
        for k in (1, 7, v_local + 3):  # one, some, more than one rank's shard holds
            got = topk_logprobs(hidden, weight[rank * v_local:(rank + 1) * v_local], targets, mask, k, options)
            want = naive_topk(hidden, weight, targets, mask, temperature, k)
            result[f"topk/{name}/k{k}/tp{world}"] = {
                "target": max_diff(got[0], want[0]), "values": max_diff(got[1], want[1]),
                "ids_equal": bool(torch.equal(got[2], want[2])), "rest": max_diff(got[3], want[3])}
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
