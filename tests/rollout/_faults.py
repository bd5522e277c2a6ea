"""Faults the rank scripts of tests/rollout inject into a weight sync's calibration (imported by them)."""
from __future__ import annotations

import torch

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


@torch.no_grad()
def nudge(param: torch.Tensor, ulps: int) -> None:
    """Moves element 0 of ``param`` by ``ulps`` units in the last place of its dtype, in place."""
    bits = param.view(-1)[:1].view(_INT_OF_WIDTH[param.element_size()])
    bits += ulps


def converter_fault(sync, megatron_suffix: str) -> str | None:
    """Calibrates with the actor's parameter ending in ``megatron_suffix`` one ulp off (a converter that got
    one element wrong) on the first rank only; returns the error message (None: the calibration passed).
    The parameter is restored afterwards."""
    import torch.distributed as dist

    from megarlhf.rollout.sync.calibration import calibrate_colocated
    from megarlhf.rollout.sync.weights import WeightSyncError

    param = next(p for n, p in sync.actor.model.named_parameters() if n.endswith(megatron_suffix))
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        nudge(param, 1)
    try:
        calibrate_colocated(sync, [], ())
        return None
    except WeightSyncError as err:
        return str(err)
    finally:
        if first:
            nudge(param, -1)
