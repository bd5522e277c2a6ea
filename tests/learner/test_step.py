"""The non-finite gate of the optimizer step (single-rank worker): a NaN advantage in skip mode leaves
every parameter, every optimizer-state tensor and the lr schedule unchanged and is counted; abort mode
raises naming the non-finite loss, gradients and (for an injected inf weight) the parameter."""
from __future__ import annotations

import math


def test_skip_leaves_state_unchanged_and_is_counted(single_run):
    r = single_run["gate"]
    assert r["state_tensors"] > 50  # parameters + Adam moments + steps
    assert r["skip_unchanged"] and r["skip_scheduler_unchanged"]
    assert r["skip_metrics"]["actor/skipped_steps"] == 1
    assert math.isnan(r["skip_metrics"]["actor/grad_norm"])


def test_abort_raises_naming_what_was_non_finite(single_run):
    r = single_run["gate"]
    loss = r["abort_loss_message"]
    assert loss and "actor update: the actor loss is non-finite (loss = nan)" in loss
    assert "no optimizer step was taken" in loss
    param = r["abort_param_message"]
    assert param and "parameters hold non-finite values on rank 0: decoder.final_layernorm.weight" in param
    assert r["abort_unchanged"]


def test_non_finite_check_reads_the_device_once(monkeypatch):
    """Names of non-finite parameters and gradients, read in ONE host transfer for the whole model (it
    used to synchronise twice per parameter; on a GPU each one stalls the queue)."""
    import torch

    from megarlhf.learner.step import _nonfinite

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    model[1].bias.data[2] = float("inf")
    model[3].weight.grad[0, 1] = float("nan")
    model[4].weight.main_grad = torch.full_like(model[4].weight, float("-inf"))  # Megatron's, preferred
    model[0].bias.grad = None
    reads, depth = [], [0]

    def counting(method, original):
        def read(self, *args, **kwargs):  # outermost calls only: a torch function mode re-dispatches
            if depth[0] == 0:
                reads.append(method)
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return read

    for method in ("tolist", "item", "__bool__", "__float__", "__int__", "cpu"):
        monkeypatch.setattr(torch.Tensor, method, counting(method, getattr(torch.Tensor, method)))
    params, grads = _nonfinite(model)
    assert (params, grads) == (["1.bias"], ["3.weight", "4.weight"])
    assert reads == ["tolist"]


def test_shared_prefixes_off_against_the_config_are_announced(monkeypatch):
    """Where the layout or the attention backend turns sharing off, the reason is named at start-up and
    nothing is shared (the metric then stays 0), instead of silently comparing whole with whole."""
    from types import SimpleNamespace

    from megarlhf.config.train import TrainConfig
    from megarlhf.learner import step

    def runtime(cp):
        return SimpleNamespace(cp=SimpleNamespace(size=cp))

    config = SimpleNamespace(train=TrainConfig())
    assert step.prefix_sharing_off_reason(config, runtime(1)) is None
    assert step.prefix_sharing_notice(config, runtime(1)) is None
    assert "context_parallel_size=2" in step.prefix_sharing_notice(config, runtime(2))
    monkeypatch.setattr(step, "shared_prefix_supported", lambda: False)  # a GPU with Transformer Engine
    notice = step.prefix_sharing_notice(config, runtime(1))
    assert "Transformer Engine" in notice and "train/shared_prefix_tokens_saved stays 0" in notice
    config.train.share_prompt_prefix = False  # not asked for: nothing to say
    assert step.prefix_sharing_notice(config, runtime(1)) is None
    config = SimpleNamespace(train=TrainConfig(packing=False))
    monkeypatch.setattr(step, "shared_prefix_supported", lambda: True)
    assert "train.packing=false" in step.prefix_sharing_notice(config, runtime(1))


def test_tokens_saved_by_sharing_counts_the_prefix_once_per_tree():
    import torch

    from megarlhf.learner import ExperienceBatch
    from megarlhf.learner.packing import Packing, build_micro_batches
    from megarlhf.learner.step import tokens_saved_by_sharing

    prompt = [5, 6, 7, 8, 9]
    batch = ExperienceBatch.from_sequences([prompt] * 3 + [[1, 2]], [[10, 11], [12], [13, 14, 15], [16, 17]],
                                           device=torch.device("cpu"))
    ids, lengths, mask = batch.input_ids, batch.lengths, batch.response_mask
    shared = build_micro_batches(ids, lengths, mask, Packing(64, share_prefixes=True))
    whole = build_micro_batches(ids, lengths, mask, Packing(64, share_prefixes=False))
    # the three rows with the 5-token prompt hold its first 4 tokens once: 2 x 4 tokens spared
    assert tokens_saved_by_sharing(shared) == 8 and tokens_saved_by_sharing(whole) == 0
