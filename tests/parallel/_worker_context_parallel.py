"""Rank script for tests/parallel/test_context_parallel.py (2 ranks, gloo).

Phase 1 (CP=1, so DP=2): every rank builds the reference GPTModel with Megatron's own local attention
and computes, on the full data, logits and parameter gradients for an unpacked batch and for each
sequence of a packed batch run on its own. It also checks the CP attention at cp=1 on the packed batch
and the token mean over DP. Phase 2 (CP=2): the same weights in a model whose core attention is the
CP attention (all_gather and p2p), fed each rank's load-balanced tokens; outputs are gathered back to
the original order and gradients summed over the CP group (what Megatron DDP does over dp x cp).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megarlhf.testing.launch import write_rank_result
from parallel import cpu_compat
from megarlhf.config.parallel import ParallelConfig
from parallel.context_parallel import (make_shard_plan, packed_seq_params_for, shard, unshard,
                                       with_cp_attention)
from parallel.runtime import init_parallel, shutdown

VOCAB, SEQ, BATCH = 96, 32, 2
PACKED_LENGTHS = [13, 32, 7, 20]  # padded for cp=2 to 16, 32, 8, 20
BLOCK = 8  # small tiles so that tiling and tile skipping are exercised


def build_model(packed_or_cp: bool, cp: int, comm: str | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=256, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, context_parallel_size=cp, cp_comm_type=comm,
        **cpu_compat.transformer_config_overrides())
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if packed_or_cp:
        spec = with_cp_attention(spec, cp, packed=True, block_size=BLOCK)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]


def shard_packed_batch(tokens, cu, cp, cp_rank, labels, loss_mask, group=None):
    """One CP rank's share of a packed row, as megarlhf.learner.packing builds it."""
    plan = make_shard_plan(cu, cp, cp_rank)
    return SimpleNamespace(tokens=shard(plan, tokens).unsqueeze(0), labels=shard(plan, labels).unsqueeze(0),
                           loss_mask=shard(plan, loss_mask).unsqueeze(0),
                           position_ids=plan.local_position_ids().unsqueeze(0),
                           packed_seq_params=packed_seq_params_for(plan, group), plan=plan)


def global_token_mean(values: torch.Tensor, mask: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the token mean over ``group``: summed over the group it is the mean."""
    count = mask.sum().detach().clone()
    dist.all_reduce(count, group=group)
    return (values * mask).sum() / count


def data():
    gen = torch.Generator().manual_seed(7)
    unpacked = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    weights = torch.randn(BATCH, SEQ, VOCAB, generator=gen) / (BATCH * SEQ)
    total = sum(PACKED_LENGTHS)
    tokens = torch.randint(0, VOCAB, (total,), generator=gen)
    labels = torch.randint(0, VOCAB, (total,), generator=gen)
    mask = (torch.rand(total, generator=gen) > 0.3).float()
    cu = [0]
    for length in PACKED_LENGTHS:
        cu.append(cu[-1] + length)
    return unpacked, weights, tokens, labels, mask, cu


def reference_phase(rank: int) -> dict:
    init_parallel(ParallelConfig(context_parallel_size=1), seed=1234)
    unpacked, weights, tokens, labels, mask, cu = data()
    model = build_model(False, 1)
    ref = {"state": {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}}
    # Unpacked batch, Megatron's DotProductAttention (causal mask built by Megatron).
    logits = model(unpacked, None, None)
    (logits * weights).sum().backward()
    ref["unpacked_logits"], ref["unpacked_grads"] = logits.detach(), grads(model)
    results = {"unpacked_grad_scale": max(g.abs().max().item() for g in ref["unpacked_grads"].values())}
    model.zero_grad()
    # Packed batch reference: each sequence alone, loss = global token mean of -logprob.
    count = mask.sum()
    per_seq_logits, per_seq_losses = [], []
    for i in range(len(PACKED_LENGTHS)):
        sl = slice(cu[i], cu[i + 1])
        seq_logits = model(tokens[sl][None], None, None)[0]
        loss = -(token_logprobs(seq_logits, labels[sl]) * mask[sl]).sum() / count
        loss.backward()
        per_seq_logits.append(seq_logits.detach())
        per_seq_losses.append(loss.detach())
    ref["packed_logits"] = torch.cat(per_seq_logits)
    ref["packed_loss"] = torch.stack(per_seq_losses).sum()
    ref["packed_grads"] = grads(model)
    results["packed_grad_scale"] = max(g.abs().max().item() for g in ref["packed_grads"].values())
    # CP attention at cp=1 on the packed row (the local spec gains packing).
    packed_model = build_model(True, 1)
    packed_model.load_state_dict(ref["state"])
    batch = shard_packed_batch(tokens, cu, 1, 0, labels=labels, loss_mask=mask)
    out = packed_model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    results["cp1_packed_logits"] = (unshard(batch.plan, out[0]) - ref["packed_logits"]).abs().max().item()
    # Token mean over DP=2: rank 0 holds sequences 0-1, rank 1 sequences 2-3.
    mine = range(0, 2) if rank == 0 else range(2, 4)
    model.zero_grad()
    losses = [-token_logprobs(model(tokens[cu[i]:cu[i + 1]][None], None, None)[0], labels[cu[i]:cu[i + 1]])
              for i in mine]
    part = global_token_mean(torch.cat(losses), torch.cat([mask[cu[i]:cu[i + 1]] for i in mine]),
                             group=dist.group.WORLD)
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)
    dp_grads = grads(model)
    for g in dp_grads.values():
        dist.all_reduce(g)
    results["dp_loss"] = (total - ref["packed_loss"]).abs().item()
    results["dp_grads"] = max((dp_grads[n] - g).abs().max().item() for n, g in ref["packed_grads"].items())
    return ref, results


def cp_phase(ref: dict, results: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    init_parallel(ParallelConfig(context_parallel_size=2), seed=1234)
    cp_group = parallel_state.get_context_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    cp_rank = cp_group.rank()
    unpacked, weights, tokens, labels, mask, cu = data()

    plan = make_shard_plan([0, SEQ], 2, cp_rank, allow_padding=False)
    megatron_rows = get_pos_emb_on_this_cp_rank(torch.arange(SEQ)[:, None], 0, cp_group)[:, 0]
    results["rotary_split_matches"] = bool(torch.equal(megatron_rows, plan.local_index))
    results["roundtrip_unpacked"] = bool(torch.equal(unshard(plan, shard(plan, unpacked, seq_dim=1),
                                                             cp_group, seq_dim=1), unpacked))
    for comm in ("all_gather", "p2p"):
        model = build_model(True, 2, comm)
        model.load_state_dict(ref["state"])
        local_logits = model(shard(plan, unpacked, seq_dim=1), None, None)
        (local_logits * shard(plan, weights, seq_dim=1)).sum().backward()
        full = unshard(plan, local_logits.detach(), cp_group, seq_dim=1)
        results[f"{comm}_unpacked_logits"] = (full - ref["unpacked_logits"]).abs().max().item()
        results[f"{comm}_unpacked_grads"] = grad_diff(model, ref["unpacked_grads"], dp_cp_group)
        if comm == "all_gather":  # the same loss on every rank, through the differentiable unshard
            model.zero_grad()
            full = unshard(plan, model(shard(plan, unpacked, seq_dim=1), None, None), cp_group, seq_dim=1)
            (full * weights).sum().backward()
            results["unshard_grads"] = grad_diff(model, ref["unpacked_grads"], dp_cp_group)

        model.zero_grad()
        batch = shard_packed_batch(tokens, cu, 2, cp_rank, labels=labels, loss_mask=mask, group=cp_group)
        local_logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
        loss = global_token_mean(-token_logprobs(local_logits[0], batch.labels[0]), batch.loss_mask[0],
                                 group=dp_cp_group)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_cp_group)
        full = unshard(batch.plan, local_logits[0].detach(), cp_group)
        results[f"{comm}_packed_logits"] = (full - ref["packed_logits"]).abs().max().item()
        results[f"{comm}_packed_loss"] = (total - ref["packed_loss"]).abs().item()
        results[f"{comm}_packed_grads"] = grad_diff(model, ref["packed_grads"], dp_cp_group)
        results["roundtrip_packed"] = bool(torch.equal(unshard(batch.plan, batch.tokens[0], cp_group), tokens))
        results["local_tokens"] = batch.plan.local_tokens


def grad_diff(model, reference: dict, group) -> float:
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, (grad - reference[name]).abs().max().item())
    return worst


def main(out_dir: str) -> None:
    ref, results = reference_phase(int(__import__("os").environ["RANK"]))
    cp_phase(ref, results)
    write_rank_result(out_dir, dist.get_rank(), results)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
