"""parallel.megatron_fallbacks: the device-resident gradient l2 norm and the vectorised packed RoPE equal
Megatron's fallbacks bit for bit; the l2 norm replaces Megatron's only where the fallback is in use."""
from __future__ import annotations

import pytest
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
    assert megatron_fallbacks.install()["l2_norm"] and megatron_fallbacks.install()["l2_norm"]
    assert clip_grads.l2_norm_impl is megatron_fallbacks.l2_norm

    def fused(*args):  # stands in for TE's / apex's kernel
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    assert not megatron_fallbacks.install()["l2_norm"]
    assert clip_grads.l2_norm_impl is fused


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_patch_equals_megatron_loop(interleaved):
    """The vectorised thd RoPE against Megatron's per-sequence loop, with a per-sequence table and with a
    per-token one (Megatron's "packed freqs"): outputs and input gradients bitwise equal."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils

    assert megatron_fallbacks.install()["rope_thd"] and megatron_fallbacks.install()["rope_thd"]
    patched = rope_utils._apply_rotary_pos_emb_thd
    assert patched.__wrapped__ is not patched
    lengths = [5, 1, 17, 9, 3]
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    freqs = torch.rand(32, 1, 1, 16, generator=g) * 6  # [max_s, 1, 1, rot_dim]: rot_dim < head dim 20
    t = torch.randn(sum(lengths), 4, 20, generator=g, requires_grad=True)

    class OneRank:  # a CP group of size 1, as Megatron passes it
        def size(self):
            return 1

        def rank(self):
            return 0

    starts = cu_seqlens[:-1].long().repeat_interleave(torch.tensor(lengths))
    per_token = freqs[torch.arange(sum(lengths)) - starts]  # each token's position within its sequence
    for table in (freqs, per_token):
        outs, grads = [], []
        for fn in (patched, patched.__wrapped__):
            out = fn(t, cu_seqlens, table, rotary_interleaved=interleaved, cp_group=OneRank())
            (grad,) = torch.autograd.grad((out * out.detach().sin()).sum(), t)
            outs.append(out.detach())
            grads.append(grad)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
        assert not torch.equal(outs[0], t.detach())
    assert not dist.is_initialized()


def test_the_tp_embedding_masks_without_waiting_for_the_device(monkeypatch):
    """Megatron's vocab-parallel embedding at TP > 1 (here: rank 1 of 2, vocab rows 8-15) masks by boolean
    indexing, two host waits per forward (seen: 2); the replacement gives the same output and gradient
    bitwise, with none."""
    from megatron.core.tensor_parallel import layers, mappings

    from megarlhf.records.host_syncs import HostSyncCounter

    monkeypatch.setattr(mappings, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    monkeypatch.setattr(layers, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    megatron_fallbacks.install()
    original = layers.VocabParallelEmbedding.forward.__wrapped__
    embedding = layers.VocabParallelEmbedding.__new__(layers.VocabParallelEmbedding)
    torch.nn.Module.__init__(embedding)
    embedding.weight = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
    embedding.vocab_start_index, embedding.vocab_end_index = 8, 16
    embedding.tp_group = type("TwoRanks", (), {"size": lambda self: 2})()
    embedding.deterministic_mode, embedding.gtp_remat_size, embedding.reduce_scatter_embeddings = False, 1, False
    ids = torch.tensor([[3, 8, 15, 16, 9], [12, 0, 11, 8, 20]])
    results = []
    for forward in (original, layers.VocabParallelEmbedding.forward):
        embedding.weight.grad = None
        with HostSyncCounter() as counter:
            out = forward(embedding, ids)
        out.pow(2).sum().backward()
        results.append((out.detach(), embedding.weight.grad.clone(), counter.count))
    (theirs, their_grad, their_syncs), (ours, our_grad, our_syncs) = results
    assert torch.equal(ours, theirs) and torch.equal(our_grad, their_grad)
    assert (ours[ids < 8] == 0).all() and (ours[ids >= 16] == 0).all() and (ours[(ids >= 8) & (ids < 16)] != 0).any()
    assert their_syncs == 2 and our_syncs == 0
