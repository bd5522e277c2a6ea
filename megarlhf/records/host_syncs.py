"""Counting the host synchronisations of a piece of training code, on any device (a diagnostic).

On a GPU every read of a device value by the host (``.item()``, ``bool(t)``, an index by a 0-d tensor), every
op whose output size depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``), ``torch.equal``/``allclose``, and every copy between host
and device stalls the host until the device's queue drains. :class:`HostSyncCounter` counts them where they
are written, so a CPU run (tests) sees what a GPU run would pay:

* **data-dependent ops and scalar reads**, each call once (a ``TorchFunctionMode``, which sees the torch
  API as training code calls it), an index by a boolean mask or a 0-d integer tensor included;
* **device-to-host copies**: ``.tolist()``, ``.numpy()``, ``.cpu()``, and ``.to("cpu")`` /
  ``.to(device="cpu")`` with the device written as a string (on a CPU run ``.to(runtime.device)`` cannot
  be told from a copy to the host: those are caught on a GPU by ``torch.cuda.set_sync_debug_mode``);
* **host-to-device copies** of Python data: ``torch.tensor(data, device=d)`` / ``torch.as_tensor(data,
  device=d)`` with ``d`` a ``torch.device`` (the runtime's; the string ``"cpu"`` names a host tensor).

Reads inside ``torch.optim`` are counted apart (``host_steps``): torch's Adam keeps its step counters on the
host unless capturable or fused, so they never wait for a GPU. Each count records where it came from (the
first frame outside torch). Counting costs a Python call per torch call: for measuring, not for training.
"""
from __future__ import annotations

import collections
import contextlib
import json
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# torch API calls that wait for the device: scalar reads, outputs sized by the data, copies to the host
ALWAYS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu", "nonzero", "argwhere",
          "masked_select", "unique", "unique_consecutive", "equal", "allclose", "bincount", "is_nonzero"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}  # sync on a boolean mask or a 0-d index


def _site(kind: str) -> tuple[str, bool]:
    """(``kind file:line`` of the first frame outside torch and this module, whether torch.optim called)."""
    stack = traceback.extract_stack()[:-2]
    own = str(Path(__file__))
    frame = next((f for f in reversed(stack) if "/torch/" not in f.filename and f.filename != own), None)
    where = f"{kind} {Path(frame.filename).name}:{frame.lineno}" if frame else kind
    return where, any("/torch/optim/" in f.filename for f in stack)


def _waits_on_index(index) -> bool:
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and (i.dtype in (torch.bool, torch.uint8)
                                                or (i.dim() == 0 and not i.is_floating_point()))
               for i in parts)


def syncs(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the torch call ``name(*args, **kwargs)`` makes the host wait for the device (module
    docstring)."""
    if name in ALWAYS:
        return True
    if name in _INDEXING:
        return len(args) > 1 and _waits_on_index(args[1])
    if name == "to":
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(device, str) and device.split(":")[0] == "cpu"
    if name == "repeat_interleave":
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        return isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None
    if name in ("tensor", "as_tensor"):
        data = args[0] if args else kwargs.get("data")
        return isinstance(kwargs.get("device"), torch.device) and not isinstance(data, torch.Tensor)
    return False


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as counter: ...`` -> ``counter.count``, ``counter.where`` (a Counter of
    ``"kind file:line"``) and ``counter.host_steps`` (torch.optim's host counters), see the module
    docstring. A torch-function mode: it sees each call where training code writes it (what torch's own
    Python functions call inside is theirs)."""

    def __init__(self):
        super().__init__()
        self.count, self.where, self.host_steps = 0, collections.Counter(), collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if syncs(name, args, kwargs):
            where, in_optimizer = _site(name)
            if in_optimizer:
                self.host_steps[where] += 1
            else:
                self.count += 1
                self.where[where] += 1
        return func(*args, **kwargs)

    def report(self) -> dict:
        return {"count": self.count, "where": dict(self.where), "host_steps": sum(self.host_steps.values()),
                "host_step_sites": sorted(self.host_steps)}


class StepSyncLog:
    """``logging.count_host_syncs``: each RL step's count, one JSON line per step in
    ``<run_dir>/logs/host_syncs-rank<N>.jsonl`` (``{"step", "count", "where", "host_steps", ...}``)."""

    def __init__(self, run_dir: str | Path, rank: int, enabled: bool):
        self.path = Path(run_dir) / "logs" / f"host_syncs-rank{rank}.jsonl" if enabled else None

    @contextlib.contextmanager
    def step(self, step: int):
        if self.path is None:
            yield
            return
        with HostSyncCounter() as counter:
            yield
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **counter.report()}) + "\n")
