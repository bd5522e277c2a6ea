"""Rank script for tests/parallel/test_cpu_compat.py: Megatron-Core GPTModel under TP=2 / PP=2 on CPU.

For each layout it builds a reference model at TP=1/PP=1 (every rank holds the full model), copies
its weights into the sharded model, and records (a) max |logit difference| between the two and
(b) the loss before and after one AdamW step through Megatron DDP, its optimizer (plain or
distributed) and its pipeline schedule, for both models.
"""
import argparse
import copy
import sys

import torch
import torch.nn.functional as F

from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.cpu_compat import transformer_config_overrides
from parallel.runtime import init_parallel

VOCAB, SEQ, BATCH, LAYERS = 256, 16, 4, 4


def build_model(pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core import parallel_state as ps

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, **transformer_config_overrides())
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope", parallel_output=False,
                    pre_process=pre_process, post_process=post_process)


def shard_state(full_state, model):
    """Slices the TP=1/PP=1 state dict into this rank's TP shard / PP stage of `model`."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    layer_offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // ps.get_pipeline_model_parallel_world_size())
    out = {}
    for name, local in model.state_dict().items():
        if local is None or "_extra_state" in name:
            continue
        src = name
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + layer_offset)
            src = ".".join(parts)
        full = full_state[src]
        if full.shape != local.shape:  # TP-split tensor: find the split dimension
            dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
            if "linear_fc1" in name:  # gated MLP: [gate; up] at TP=1, [gate_r; up_r] on rank r
                gate, up = full.chunk(2, dim=0)
                full = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
            else:  # QKV is grouped per query group, so a plain chunk is the rank's groups
                full = full.chunk(tp, dim=dim)[tp_rank]
        out[name] = full.clone()
    model.load_state_dict(out, strict=False)


def train_two_steps(model, use_distributed_optimizer, tokens, labels):
    """Returns [loss before, loss after one AdamW step] through Megatron's DDP, optimizer and schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core import parallel_state as ps

    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                                                 use_distributed_optimizer=use_distributed_optimizer), [ddp])
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def forward_step(data_iterator, module):
        out = module(tokens, positions, None)

        def loss_func(logits):
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
            return loss, {"loss": loss.detach()}

        return out, loss_func

    losses = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        result = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
            seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
        opt.step()
        loss = result[0]["loss"].item() if result else float("nan")
        if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage has the loss
            t = torch.tensor([loss if ps.is_pipeline_last_stage() else 0.0])
            torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
            loss = t.item()
        losses.append(loss)
    return losses


def pipeline_logits(model, tokens):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    captured = {}

    def forward_step(data_iterator, module):
        out = module(tokens, positions, None)

        def loss_func(logits):
            captured["logits"] = logits.detach().clone()
            return logits.sum() * 0, {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=True)
    return captured.get("logits")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

    init_parallel(ParallelConfig(), seed=11)
    reference = build_model()
    full_state = copy.deepcopy(reference.state_dict())
    ref_logits = pipeline_logits(reference, tokens)
    ref_losses = train_two_steps(reference, args.distributed_optimizer, tokens, labels)

    launch = init_parallel(ParallelConfig(args.tp, args.pp), seed=11).launch
    from megatron.core import parallel_state as ps

    model = build_model(ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    shard_state(full_state, model)
    logits = pipeline_logits(model, tokens)
    logit_diff = (logits - ref_logits).abs().max().item() if logits is not None else None
    losses = train_two_steps(model, args.distributed_optimizer, tokens, labels)
    write_rank_result(args.out_dir, launch.rank, {
        "logit_max_abs_diff": logit_diff, "reference_losses": ref_losses, "losses": losses,
        "compiler_imported": "torch._inductor.compile_fx" in sys.modules})


if __name__ == "__main__":
    main()
