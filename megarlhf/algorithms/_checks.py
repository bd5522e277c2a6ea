"""Input checks and masked reductions shared by the RL numerics modules of ``megarlhf.algorithms``.

Every function in the package reads only masked-in positions: padding may hold anything (NaN, inf,
garbage) and must not reach an output or a gradient. :func:`zero_masked` is the one way padding is
neutralised: ``torch.where`` before any arithmetic, so that no NaN enters the forward graph (a
``mask * x`` product would keep NaN, and a ``where`` after the arithmetic still leaks NaN gradients).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def check_shape(where: str, name: str, tensor: Tensor | None, shape: tuple[int, ...]) -> None:
    """Raises ``ValueError`` naming ``where`` and ``name`` unless ``tensor`` has exactly ``shape``."""
    if tensor is None:
        return
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def check_mask(where: str, name: str, mask: Tensor) -> Tensor:
    """Returns ``mask`` as bool [B, T]; raises unless it is 2-D with only 0/1 values."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{where}: {name} must be a 2-D [B, T] tensor, got {shape}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{where}: {name} must hold only 0 and 1")
        mask = mask.bool()
    return mask


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The floating dtype to compute in: the inputs' promoted float dtype, at least float32."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is true, 0 elsewhere; padding values (even NaN) never enter the graph."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over masked-in positions (0 when there are none)."""
    count = mask.sum()
    return zero_masked(x, mask).sum() / count.clamp(min=1)


def all_reduce_sum(tensor: Tensor, group) -> Tensor:
    """Sums ``tensor`` over ``group`` (a torch.distributed process group); identity when group is None."""
    if group is None:
        return tensor
    if not dist.is_initialized():
        raise RuntimeError("a process group was given but torch.distributed is not initialised")
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def group_size(group) -> int:
    """Number of ranks in ``group``; 1 when group is None (single process)."""
    return 1 if group is None else dist.get_world_size(group)
