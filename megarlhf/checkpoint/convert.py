"""HF model directory <-> megarlhf distributed checkpoint, and the ``megarlhf convert`` command.

* :func:`hf_to_megatron`: builds this rank's shard of the model from an HF directory (each rank reads only
  its TP slice of its pipeline stage, via :mod:`model_providers.hf_checkpoint`) and saves it with
  :func:`~megarlhf.checkpoint.distributed.save_checkpoint`. The HF ``config.json``, tokenizer and
  generation-config files go into the checkpoint's ``hf/`` folder, inside the same atomic save, so the
  checkpoint alone is enough to rebuild the model and to export it again.
* :func:`megatron_to_hf`: rebuilds the model from ``hf/``, loads the checkpoint at whatever TP/PP the job
  was launched with, and exports an HF directory through :func:`model_providers.hf_checkpoint.
  export_hf_checkpoint` (TP gather / PP broadcast; rank 0 writes).

The TP/PP of a conversion only decides how the work and memory are spread over the ranks: checkpoints are
resharded on load, so one written at TP=1 loads at TP=2 and vice versa. The dtype is kept: the checkpoint
holds the HF dtype (``config.dtype``) unless told otherwise, so HF -> Megatron -> HF is bit-identical.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from megarlhf.checkpoint.distributed import CheckpointError, checkpoint_metadata, load_checkpoint, save_checkpoint
from megarlhf.core.outputs import check_replaceable
from megarlhf.core.errors import ConfigError

HF_SUBDIR = "hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_dtype(hf_config) -> torch.dtype:
    """The dtype an HF config declares (``dtype``, formerly ``torch_dtype``); float32 when it names none."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(value, str):
        if value not in DTYPES:
            raise CheckpointError(f"HF config dtype {value!r} is not one of {sorted(DTYPES)}")
        value = DTYPES[value]
    return value


def _check_hf_dir(hf_dir: Path) -> None:
    if not hf_dir.is_dir():
        raise CheckpointError(f"HF model directory {hf_dir} does not exist")
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not an HF model directory: it has no config.json")


def _hf_side_files(hf_dir: Path) -> dict[str, Path]:
    """config.json plus the tokenizer / generation files the exporter copies (never weights)."""
    from model_providers.hf_checkpoint import COPIED_FILE_PATTERN

    files = {f"{HF_SUBDIR}/config.json": hf_dir / "config.json"}
    for path in sorted(hf_dir.iterdir()):
        if path.is_file() and COPIED_FILE_PATTERN.match(path.name):
            files[f"{HF_SUBDIR}/{path.name}"] = path
    return files


def _check_output(out: Path, overwrite: bool) -> None:
    check_replaceable(out, overwrite, "output")


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                   overwrite: bool = False) -> Path:
    """Converts an HF model directory into a distributed checkpoint at ``out_dir``.

    Collective over all ranks; Megatron's parallel state must be initialised (any TP/PP the model allows).
    ``dtype`` defaults to the HF config's dtype. Returns the checkpoint path.
    """
    from model_providers.hf_checkpoint import load_hf_model

    hf_dir, out = Path(hf_dir).absolute(), Path(out_dir).absolute()
    _check_hf_dir(hf_dir)
    _check_output(out, overwrite)
    from model_providers import get_provider

    dtype = dtype or _hf_dtype(get_provider(hf_dir).hf_config)
    # No random init: every parameter is overwritten by the HF weights right away.
    provider, model = load_hf_model(hf_dir, params_dtype=dtype, perform_initialization=False)
    metadata = {"model_type": provider.model_type, "dtype": str(dtype).removeprefix("torch."),
                "hf_config_dir": HF_SUBDIR, "converted_from": str(hf_dir)}
    return save_checkpoint(out, model, metadata=metadata, overwrite=overwrite, files=_hf_side_files(hf_dir))


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, hf_config_dir: str | None = None,
                   dtype: torch.dtype | None = None, max_shard_bytes: int | None = None,
                   overwrite: bool = False) -> Path:
    """Exports the distributed checkpoint at ``ckpt_dir`` as an HF directory at ``out_dir``.

    Collective; loads at the current TP/PP. The HF config and tokenizer come from the checkpoint's ``hf/``
    folder unless ``hf_config_dir`` names another directory. ``dtype`` defaults to the checkpoint's.
    ``max_shard_bytes`` caps each safetensors file (default: the exporter's); rank 0 holds one file's
    tensors at a time, so a smaller cap lowers the export's peak memory.
    """
    from model_providers import get_provider
    from model_providers.hf_checkpoint import export_hf_checkpoint

    ckpt, out = Path(ckpt_dir).absolute(), Path(out_dir).absolute()
    info = checkpoint_metadata(ckpt)
    if hf_config_dir:
        hf_dir = Path(hf_config_dir).absolute()
    else:
        hf_dir = ckpt / info["metadata"].get("hf_config_dir", HF_SUBDIR)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"no HF config at {hf_dir / 'config.json'}: the checkpoint {ckpt} was not written "
                              "by hf-to-megatron; name the model's HF config directory explicitly")
    _check_output(out, overwrite)
    saved_dtype = info["metadata"].get("dtype") or info["model"].get("params_dtype", "float32")
    dtype = dtype or DTYPES[saved_dtype]
    provider = get_provider(hf_dir)
    model = provider.build_model(DTYPES[saved_dtype], perform_initialization=False)
    load_checkpoint(ckpt, model)
    shard_cap = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return export_hf_checkpoint(model, provider, out, source_dir=hf_dir, dtype=dtype, overwrite=overwrite,
                                **shard_cap)


# ---- the ``convert`` command -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``convert`` command's arguments: one sub-command per direction."""
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = directions.add_parser("hf-to-megatron", help="HF model directory -> distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to create")
    to_hf = directions.add_parser("megatron-to-hf", help="distributed checkpoint -> HF model directory")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint directory written by hf-to-megatron")
    to_hf.add_argument("--out", required=True, help="HF model directory to create")
    to_hf.add_argument("--hf-config", default=None,
                       help="HF directory with config.json/tokenizer (default: the checkpoint's hf/ folder)")
    to_hf.add_argument("--max-shard-mib", type=int, default=None,
                       help="largest safetensors file in MiB (default 5120); smaller lowers peak memory")
    for sub in (to_mcore, to_hf):
        # The layout of the conversion run only; checkpoints reshard on load.
        sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this run (default 1; the "
                         "checkpoint loads at any size)")
        sub.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this run (default 1)")
        sub.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                         help="tensor dtype (default: keep the source's)")
        sub.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    """Runs one conversion in this process (a rank of torchrun/srun, or alone)."""
    from megarlhf.config.parallel import ParallelConfig
    from parallel.runtime import init_parallel, shutdown

    try:
        parallel = ParallelConfig(args.tp, args.pp)
    except ValueError as err:  # --tp / --pp: the user's flags
        raise ConfigError(f"--tp {args.tp} --pp {args.pp}: {err}") from None
    dtype = DTYPES[args.dtype] if args.dtype else None
    # Path errors first, before any process group or Megatron import.
    if args.direction == "hf-to-megatron":
        _check_hf_dir(Path(args.hf).absolute())
    else:
        checkpoint_metadata(args.ckpt)
    _check_output(Path(args.out).absolute(), args.overwrite)
    try:
        launch = init_parallel(parallel).launch
        if args.direction == "hf-to-megatron":
            path = hf_to_megatron(args.hf, args.out, dtype=dtype, overwrite=args.overwrite)
        else:
            cap = None if args.max_shard_mib is None else args.max_shard_mib * 2**20
            path = megatron_to_hf(args.ckpt, args.out, hf_config_dir=args.hf_config, dtype=dtype,
                                  max_shard_bytes=cap, overwrite=args.overwrite)
    finally:
        shutdown()
    if launch.rank == 0:
        print(f"wrote {path}")
    return 0
