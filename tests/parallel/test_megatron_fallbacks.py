"""parallel.megatron_fallbacks: the device-resident gradient l2 norm equals Megatron's fallback bit for bit,
and replaces it only where the fallback is in use."""
from __future__ import annotations

import torch

from parallel import megatron_fallbacks


def test_l2_norm_equals_megatrons_fallback_bitwise():
    from megatron.core.utils import local_multi_tensor_l2_norm

    if not torch.cuda.is_available():
        from parallel import cpu_compat

        cpu_compat.activate()  # Megatron's fallback puts its result on "cuda"
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) * scale
             for shape, scale in [((7, 5), 1.0), ((13,), 1e-3), ((4, 4, 3), 30.0), ((1,), 0.0)]]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = megatron_fallbacks.l2_norm(2048 * 32, flag, [grads], False)
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [grads], False)
    assert ours.shape == theirs.shape == (1,) and ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)
    naive = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    assert abs(float(ours) - float(naive)) <= 1e-6 * float(naive)


def test_install_replaces_only_the_fallback_and_is_idempotent(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    assert megatron_fallbacks.install() and megatron_fallbacks.install()
    assert clip_grads.l2_norm_impl is megatron_fallbacks.l2_norm

    def fused(*args):  # stands in for TE's / apex's kernel
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    assert not megatron_fallbacks.install()
    assert clip_grads.l2_norm_impl is fused
