"""The host-sync counter sees every idiom that makes a GPU's host wait (each one seen uncounted by the
counter it replaces, which read only .item/.tolist/.cpu/.numpy/float/int/bool), and nothing that does not."""
from __future__ import annotations

import pytest
import torch

from megarlhf.records.host_syncs import HostSyncCounter

DEVICE = torch.device("cpu")  # the runtime's device object, as training code passes it
X = torch.arange(12.0).reshape(3, 4)
MASK = X > 5

SYNCING = {
    "item": lambda: X.sum().item(),
    "float": lambda: float(X.sum()),
    "bool": lambda: bool(X.sum() > 0),
    "nonzero": lambda: MASK.nonzero(),
    "mask indexing": lambda: X[MASK],
    "mask assignment": lambda: X.clone().__setitem__(MASK, 0.0),
    "unique": lambda: torch.unique(X),
    "equal": lambda: torch.equal(X, X),
    "allclose": lambda: torch.allclose(X, X),
    "masked_select": lambda: X.masked_select(MASK),
    "repeat_interleave by a tensor": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
    "index by a 0-d tensor": lambda: X[torch.tensor(1)],
    "to('cpu')": lambda: X.to("cpu"),
    "to(device='cpu')": lambda: X.to(device="cpu"),
    "cpu()": lambda: X.cpu(),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "host floats to the device": lambda: torch.tensor([1.0, 2.0], device=DEVICE),
    "as_tensor to the device": lambda: torch.as_tensor([1, 2], device=DEVICE),
}
QUIET = {
    "arithmetic": lambda: (X * 2 + 1).sum(),
    "where": lambda: torch.where(MASK, X, 0.0),
    "masked_fill": lambda: X.masked_fill(MASK, 0.0),
    "index by a tensor of ints": lambda: X[torch.tensor([0, 2])],
    "repeat_interleave with output_size": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]),
                                                                                    output_size=6),
    "a host tensor": lambda: torch.tensor([1.0, 2.0]),
    "a device tensor made there": lambda: torch.zeros(3, device=DEVICE),
    "to the runtime's device": lambda: X.to(DEVICE),
}


@pytest.mark.parametrize("idiom", sorted(SYNCING))
def test_every_syncing_idiom_is_counted_once(idiom):
    with HostSyncCounter() as counter:
        SYNCING[idiom]()
    assert counter.count == 1, (idiom, dict(counter.where))
    assert all("test_host_sync_counter.py" in where for where in counter.where), counter.where


@pytest.mark.parametrize("idiom", sorted(QUIET))
def test_what_does_not_wait_is_not_counted(idiom):
    with HostSyncCounter() as counter:
        QUIET[idiom]()
    assert counter.count == 0, (idiom, dict(counter.where))


def test_the_optimizers_host_counters_are_counted_apart():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(3)
    with HostSyncCounter() as counter:
        optimizer.step()
    assert counter.count == 0 and sum(counter.host_steps.values()) >= 1


def test_the_counter_leaves_torch_as_it_was():
    before = (torch.Tensor.tolist, torch.Tensor.to, torch.tensor)
    with HostSyncCounter():
        pass
    assert (torch.Tensor.tolist, torch.Tensor.to, torch.tensor) == before
