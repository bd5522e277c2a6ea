"""Adapter-only weight sync of a LoRA policy: the engine keeps the frozen base it loaded and receives only
the adapters, verified bit for bit where its LoRA kernels read them.

Chosen by ``rollout.weight_sync.lora: adapter`` (the default, ``merged``, sends ``W + s B A`` into a
plain engine through :mod:`megarlhf.rollout.sync.weights`). The trade-off, measured in
``bench/bench_lora_sync.py``: a sync moves ~1-3% of the bytes, but every generated token then runs vLLM's
LoRA kernels on top of the base GEMMs.

One sync (collective over the trainer ranks):

1. the actor's adapters are gathered over TP and pipeline stages as PEFT tensors
   (:func:`model_providers.peft_adapter.peft_tensors`) on every rank; they are read to the host once, as
   vLLM loads adapters from a directory, and written as a PEFT adapter directory of this rank's own in
   memory-backed storage (``/dev/shm`` where it exists; the host copy is of the adapters only);
2. the engine loads it under a new adapter id, drops the previous one and its prefix cache
   (:meth:`~megarlhf.rollout.engines.api.RolloutEngine.load_adapter`), and fingerprints the adapter slot its
   LoRA kernels read in every LoRA layer (:func:`~megarlhf.rollout.engines.weights.adapter_report`);
3. the trainer predicts those fingerprints (:func:`expected_slots`) from the host tensors it wrote, doing
   what vLLM does to them: cast to the engine's dtype, fold the scale ``alpha / rank`` into B (one
   rounding in that dtype), pad both factors to the rank of the engine's adapter slot with zeros, and keep one
   slice per HF projection of a fused layer (``qkv_proj``: q, k, v). Compared exactly: a missing, stale,
   rescaled or misplaced adapter, or one the trainer did not send, stops the run with a
   :class:`~megarlhf.rollout.sync.weights.WeightSyncError` naming it;
4. the probe forward, as after a merged sync: the engine scores the probe through its LoRA kernels.

The disaggregated placement (:mod:`megarlhf.rollout.disaggregated`) sends the same tensors from the
trainers' device as one bucket to every engine rank, which writes and loads them
(:class:`AdapterDirectory`) and compares its slots with the source's :func:`expected_slots`.

The base weights are never sent: they are frozen, and the gates' calibration proves before the first sync
that the engine's own load of ``model.path`` equals the trainer's conversion of it bit for bit (with the
adapters off: :func:`megarlhf.rollout.sync.calibration.trainer_fingerprints`).
"""
from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from megarlhf.rollout.engines.api import ENGINES
from megarlhf.rollout.engines.fingerprint import fingerprint, to_host
from megarlhf.rollout.sync.weights import WeightSync, hex_fingerprint, sync_metrics
from model_providers import get_provider
from model_providers.peft_adapter import PEFT_PREFIX, peft_config, peft_tensors, target_modules, write_peft_adapter

_FACTORS = {"lora_A": "lora_a", "lora_B": "lora_b"}  # PEFT's factor names -> vLLM's
SLOTS_CHECK = "fingerprints of the engine's LoRA adapter slots"


def engine_slot_name(peft_name: str, fused: dict[str, list[str]]) -> str:
    """The name :func:`~megarlhf.rollout.engines.weights.adapter_report` gives the slot that holds the PEFT
    tensor ``peft_name``: ``base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight`` ->
    ``model.layers.0.self_attn.qkv_proj.lora_b.1`` (``fused``: the engine's fused modules and their parts)."""
    module, factor, leaf = peft_name.removeprefix(PEFT_PREFIX).rsplit(".", 2)
    if factor not in _FACTORS or leaf != "weight":
        raise ValueError(f"adapter sync: {peft_name} is not a PEFT LoRA factor")
    parent, _, projection = module.rpartition(".")
    slot = next(((name, parts.index(projection)) for name, parts in fused.items() if projection in parts),
                (projection, 0))
    return f"{parent}.{slot[0]}.{_FACTORS[factor]}.{slot[1]}"


def expected_slots(tensors: dict[str, torch.Tensor], fused: dict[str, list[str]], *, max_rank: int,
                   dtype: torch.dtype, scale: float) -> dict[str, torch.Tensor]:
    """The fingerprints the engine's adapter slots must have after loading ``tensors`` (PEFT-named, as
    written): each factor cast to ``dtype``, B multiplied by ``scale`` in that dtype, both zero-padded to
    ``max_rank`` (module docstring, step 3). Zero padding adds nothing to a fingerprint, so A (rank rows
    of a ``max_rank``-row slot) is fingerprinted as it is and only B's columns are padded."""
    prints = {}
    for name, tensor in tensors.items():
        slot = engine_slot_name(name, fused)
        value = tensor.to(dtype)
        if slot.split(".")[-2] == "lora_b":
            value = F.pad(value * scale, (0, max_rank - value.shape[1]))
        prints[slot] = fingerprint(value)
    return prints


def slot_problems(expected: dict[str, tuple[int, int]], report: dict) -> list[str]:
    """Where the engine's adapter slots differ from the trainer's prediction (empty: bitwise equal). A slot
    the trainer sent nothing for must be empty (all zeros: fingerprint 0)."""
    problems = list(report["problems"])
    held = report["adapters"]
    for name, value in held.items():
        want = expected.get(name, (0, 0))
        if tuple(value) != tuple(want):
            what = "holds an adapter the trainer did not send" if name not in expected else "differs from the trainer's"
            problems.append(f"engine LoRA slot {name} {what}: fingerprint {hex_fingerprint(value)}, trainer "
                            f"{hex_fingerprint(want)}")
    problems += [f"no engine LoRA slot holds the trainer's {name}" for name in expected if name not in held]
    return problems


def adapter_only(config) -> bool:
    """Whether a run's engines receive LoRA adapters rather than merged weights (``rollout.weight_sync.lora``)."""
    return config.model.lora is not None and config.rollout.weight_sync.lora == "adapter"


def adapter_slot_rank(config) -> int:
    """The rank of the adapter slot the run's engines keep for ``model.lora`` (their kernels pad with zeros)."""
    spec = ENGINES.get(config.rollout.backend)
    if spec.adapter_rank is None:
        raise ValueError(f"adapter sync: rollout.backend={config.rollout.backend!r} does not load adapters alone")
    return spec.adapter_rank(config.model.lora.rank)


def engine_lora(config) -> dict:
    """The LoRA arguments of ``EngineConfig.from_rollout`` for a run: the rank and the projections adapted
    under adapter-only sync; {} otherwise."""
    lora = config.model.lora
    if not adapter_only(config):
        return {}
    return {"lora_rank": lora.rank, "lora_modules": tuple(target_modules(get_provider(config.model.path), lora))}


class AdapterDirectory:
    """Where this process writes the adapters its engine loads: a private directory in memory-backed storage
    (``/dev/shm`` where it exists and has room for two adapters, else the temporary directory), removed
    when the object is collected or the process exits. Each adapter gets its own directory (vLLM may
    reload an adapter from its path later); the previous one is removed once the next has loaded."""

    def __init__(self):
        self.scratch, self._cleanup, self.count, self.current = None, None, 0, None

    def _place(self, nbytes: int) -> Path:
        if self.scratch is None:
            shm = Path("/dev/shm")
            roomy = shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes + 2**26
            self.scratch = Path(tempfile.mkdtemp(prefix="megarlhf-adapter-", dir=shm if roomy else None))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.scratch, True)
        self.count += 1
        return self.scratch / f"policy-{self.count}"

    def load_into(self, engine, tensors: dict[str, torch.Tensor], adapter_config: dict) -> dict:
        """Writes the adapter and has ``engine`` load it; returns the engine's adapter-slot report."""
        path = self._place(sum(t.numel() * t.element_size() for t in tensors.values()))
        write_peft_adapter(tensors, adapter_config, path)
        report = engine.load_adapter(str(path))
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path
        return report


def load_problems(directory: AdapterDirectory, engine, tensors: dict[str, torch.Tensor], adapter_config: dict
                  ) -> tuple[dict, list[str]]:
    """(report, problems) of loading ``tensors`` into ``engine``: a failed load is a problem to agree on,
    not an exception on one rank while the others wait for the verdict."""
    try:
        return directory.load_into(engine, tensors, adapter_config), []
    except Exception as err:  # noqa: BLE001 - reported to every rank through the verdict
        return {"adapters": {}, "problems": [], "seconds": 0.0}, [f"the engine failed to load the adapter: {err}"]


def host_adapter(actor, lora) -> dict[str, torch.Tensor]:
    """The actor's adapters as PEFT tensors on the host (collective over the trainer ranks)."""
    tensors = peft_tensors(actor.model, actor.provider, lora)
    return {name: tensor.detach().cpu() for name, tensor in tensors.items()}  # host: vLLM reads a directory


def adapter_metrics(host: dict[str, torch.Tensor], seconds: float) -> dict[str, float]:
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    return sync_metrics({"bytes": nbytes, "buckets": 1, "max_bucket_bytes": nbytes}, len(host), seconds)


class AdapterSync(WeightSync):
    """Sends the actor's LoRA adapters to a LoRA-enabled colocated engine and proves they arrived (module
    docstring); the engine must have been built with ``lora_rank`` > 0 (:func:`engine_lora`)."""

    def __init__(self, engine, actor, config):
        super().__init__(engine, actor, config)
        self.lora = config.model.lora
        self.max_rank = adapter_slot_rank(config)
        self.directory = AdapterDirectory()
        self.adapter_config = peft_config(actor.provider, self.lora, config.model.path)

    def sync(self) -> dict[str, float]:
        start = time.perf_counter()
        host = host_adapter(self.actor, self.lora)
        report, problems = load_problems(self.directory, self.engine, host, self.adapter_config)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        expected = to_host(expected_slots(host, self.fused, max_rank=self.max_rank, dtype=self.engine_dtype,
                                          scale=self.lora.scale))
        trainer_seconds = time.perf_counter() - start
        self.agree(problems or slot_problems(expected, report), SLOTS_CHECK)
        metrics = adapter_metrics(host, seconds)
        metrics.update({"time/weight_sync_fingerprint_trainer_s": trainer_seconds,
                        "time/weight_sync_fingerprint_engine_s": report["seconds"]})
        return {**metrics, **self.probe_forward()}
