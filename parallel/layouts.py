"""A second parallel layout in the run's own processes, for a model that is split differently from the
trained ones (a distillation teacher larger than its student at a larger TP, say).

Megatron-Core keeps one layout per process: its groups, sizes and ranks live in the module globals of
``megatron.core.parallel_state``, which its layers read when they are built and its schedules read when they
run. :class:`OwnLayout` makes a second set of those groups over the same (trainer) ranks at start-up, keeps
them aside, and puts them in place only while its model is built or runs (:meth:`OwnLayout.active`); the
run's own groups are put back after, whatever happens inside. Nothing else may run inside ``active``.

Making the second set never tears the first down: Megatron's ``destroy_model_parallel`` would destroy the
run's gloo groups, which the distributed optimizer holds (its gathered checkpoint format uses them), so the
globals are only unset before ``initialize_model_parallel`` runs again, and the layout makes no gloo groups
(a frozen model has no optimizer to need them).

Its :class:`~parallel.runtime.Runtime` has the layout's TP/PP/CP/DP groups and the run's ``world``,
``trainers``, ``channel`` and ``payload``, so the collectives that megarlhf's own code makes (the log-prob
op, the pipeline broadcast, context-parallel packing) follow the layout too.
"""
from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager

from megarlhf.config.parallel import LayoutError, ParallelConfig
from parallel import runtime as run_state
from parallel.runtime import Runtime

# parallel_state's groups, sizes, ranks and rank lists, and the list of every group it made
_MEGATRON_GLOBAL = re.compile(r"_[A-Z][A-Z0-9_]*|_global_process_group_list")


def _megatron_state() -> dict:
    """Every module global of Megatron's parallel state, plus megarlhf's uneven stage split."""
    from megatron.core import parallel_state as ps

    state = {name: value for name, value in vars(ps).items() if _MEGATRON_GLOBAL.fullmatch(name)}
    return {"megatron": state, "stage_split": dict(run_state._STAGE_SPLIT)}


def _unset(state: dict) -> dict:
    """``state`` as parallel_state holds it before any layout is made (its one dict global empty, the rest
    None), without destroying a group."""
    return {"megatron": {name: {} if isinstance(value, dict) else None for name, value in state["megatron"].items()},
            "stage_split": {}}


def _put_back(state: dict) -> None:
    from megatron.core import parallel_state as ps

    for name, value in state["megatron"].items():
        setattr(ps, name, value)
    run_state._STAGE_SPLIT = dict(state["stage_split"])


class OwnLayout:
    """The groups of ``parallel`` over the trainer ranks of ``base`` (the run's runtime). Collective over the
    trainer ranks to make; ``what`` names the setting in errors (``"teacher.parallel"``)."""

    def __init__(self, parallel: ParallelConfig, base: Runtime, what: str):
        try:
            parallel.validate(base.trainers.size)
        except LayoutError as err:
            raise LayoutError(f"{what}: {err} (the trainer ranks)") from None
        self.parallel, self.base, self.what = parallel, base, what
        run_groups = _megatron_state()
        try:
            _put_back(_unset(run_groups))
            run_state._initialize_megatron(parallel, local_world_size=base.trainers.size, gloo_groups=False)
            own = run_state.build_runtime(base.launch, base.trainers)  # collective: the layout's replica groups
            self.runtime = dataclasses.replace(own, world=base.world, channel=base.channel, payload=base.payload)
            self.state = _megatron_state()
        finally:
            _put_back(run_groups)
        # (the run's data-parallel rank, this layout's) of every trainer rank, in trainer-rank order
        self.dp_ranks: list[tuple[int, int]] = base.all_gather_objects((base.dp.rank, self.runtime.dp.rank),
                                                                       over="trainers")

    @contextmanager
    def active(self):
        """Megatron's parallel state holds this layout's groups inside; the run's come back after. Yields
        this layout's runtime."""
        run_groups = _megatron_state()
        _put_back(self.state)
        try:
            yield self.runtime
        finally:
            _put_back(run_groups)
