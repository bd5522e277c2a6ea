"""Rank script for tests/test_checkpoint.py. Usage: _worker_checkpoint.py MODE HF_DIR WORK_DIR

MODE "reshard" (2 ranks): load the tiny HF model at TP=2, save a distributed checkpoint, then load it at
    TP=1 (DP=2) and at PP=2; save again from PP=2 and load that at TP=2. At every layout it records the
    logits against the saved model's and against HF transformers', and whether every HF-named tensor of the
    loaded model equals the HF safetensors file bit for bit.
MODE "atomic" (1 process, no launcher): saves that fail part-way (an exception after the tensor files are written; a
    crash between the two renames of an overwrite) and the error messages of bad loads.
MODE "helpers" (1 process, no launcher): one synchronous save; records the child processes left and Megatron's
    write-results queue.
MODE "full_disk" (1 process, no launcher): a save whose writer fails with ENOSPC; records the error and what is left.
MODE "kill" (1 process, no launcher): saves checkpoint "ckpt" (step 1), records a hash of its files, then
    overwrites it with a save that SIGKILLs its own process right after Megatron wrote the tensor files.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarlhf.checkpoint import CheckpointError, checkpoint_metadata, load_checkpoint, save_checkpoint
from megarlhf.testing.launch import write_rank_result
from megarlhf.config.parallel import ParallelConfig
from parallel.runtime import init_parallel, shutdown

BATCH, SEQ = 2, 11


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Unpadded full-vocab logits on the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    else:
        def step(_data, chunk):
            return chunk(input_ids=ids, position_ids=pos, attention_mask=None), lambda out, non_loss_data=False: out

        outs = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                           num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
                                           forward_only=True, collect_non_loss_data=True)
        if not ps.is_pipeline_last_stage():
            return None
        logits = outs[0]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits


def weights_equal_hf(model, provider, hf_dir: Path) -> bool:
    """Every HF-named tensor of the (sharded) model equals the HF file's, bit for bit (collective)."""
    from model_providers.hf_checkpoint import iter_hf_weights

    source = load_file(str(hf_dir / "model.safetensors"))
    got = dict(iter_hf_weights(model, provider))
    return got.keys() == source.keys() and all(torch.equal(got[k], source[k]) for k in source)


def reshard(hf_dir: Path, work: Path) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from model_providers import get_provider
    from model_providers.hf_checkpoint import load_hf_model

    launch = init_parallel(ParallelConfig(tensor_model_parallel_size=2)).launch
    provider, model = load_hf_model(hf_dir)
    ids = torch.randint(0, provider.hf_config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    saved_logits = full_logits(model, ids)
    with torch.no_grad():
        hf_logits = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids=ids).logits
    vocab = provider.hf_config.vocab_size
    extra = {"step": 7, "sampler": {"epoch": 1, "offset": 96}, "rng": torch.arange(4)}
    save_checkpoint(work / "tp2", model, extra, metadata={"step": 7})
    result = {"saved_vs_hf": (saved_logits[..., :vocab] - hf_logits).abs().max().item(),
              "marker": checkpoint_metadata(work / "tp2")}
    for name, (tp, pp), ckpt in (("tp1", (1, 1), "tp2"), ("pp2", (1, 2), "tp2"), ("tp2_from_pp2", (2, 1), "pp2")):
        init_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=99)
        fresh = get_provider(hf_dir).build_model()  # random weights until loaded
        before_equal = weights_equal_hf(fresh, provider, hf_dir)
        loaded_extra = load_checkpoint(work / ckpt, fresh)
        logits = full_logits(fresh, ids)
        r = {"weights_equal_before_load": before_equal, "weights_equal": weights_equal_hf(fresh, provider, hf_dir),
             "extra_state": {k: v.tolist() if torch.is_tensor(v) else v for k, v in loaded_extra.items()},
             "last_stage": ps.is_pipeline_last_stage()}
        if logits is not None:
            r["padded_vocab"] = logits.shape[-1]
            r["vs_saved"] = (logits[..., :vocab] - saved_logits[..., :vocab]).abs().max().item()
            r["vs_hf"] = (logits[..., :vocab] - hf_logits).abs().max().item()
        result[name] = r
        if name == "pp2":
            save_checkpoint(work / "pp2", fresh, loaded_extra)
    write_rank_result(work / "results", launch.rank, result)
    shutdown()


def _error(fn) -> str | None:
    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return None


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def error_messages(model, hf_dir: Path, ckpt: Path, work: Path) -> dict:
    """The CheckpointError messages of bad loads and saves (None where nothing was raised)."""
    from megatron.core import dist_checkpointing

    from model_providers import get_provider

    incomplete = work / "incomplete"
    incomplete.mkdir()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(incomplete))  # Megatron's files, no marker
    other = get_provider(hf_dir.parent / "llama").build_model()
    return {
        "missing": _error(lambda: load_checkpoint(work / "nope", model)),
        "incomplete": _error(lambda: load_checkpoint(incomplete, model)),
        "exists": _error(lambda: save_checkpoint(ckpt, model)),
        "wrong_model": _error(lambda: load_checkpoint(ckpt, other)),
        "not_json": _error(lambda: save_checkpoint(work / "x", model, metadata={"t": torch.ones(1)})),
    }


def atomic(hf_dir: Path, work: Path) -> None:
    from megatron.core import dist_checkpointing

    from model_providers.hf_checkpoint import load_hf_model

    launch = init_parallel(ParallelConfig()).launch
    provider, model = load_hf_model(hf_dir)
    expected = _params(model)
    ckpt = work / "ckpt"
    result = {}
    # The "kill" run left a partial save of ckpt behind: its final name must still hold step 1, loadable.
    fresh = provider.build_model()
    load_checkpoint(ckpt, fresh)
    result["after_kill_step"] = checkpoint_metadata(ckpt)["metadata"]["step"]
    result["after_kill_equal"] = all(torch.equal(a, b) for a, b in zip(_params(fresh), expected))

    real_save = dist_checkpointing.save

    def save_then_fail(state, directory, **kwargs):  # the tensor files exist, the marker does not
        real_save(state, directory, **kwargs)
        raise OSError("simulated disk failure after writing the tensors")

    dist_checkpointing.save = save_then_fail
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    try:
        save_checkpoint(ckpt, model, metadata={"step": 2}, overwrite=True)
        result["failed_save_raised"] = False
    except CheckpointError as err:
        result["failed_save_raised"] = str(err)
    dist_checkpointing.save = real_save
    result["after_failure_step"] = checkpoint_metadata(ckpt)["metadata"]["step"]
    fresh = provider.build_model()
    load_checkpoint(ckpt, fresh)
    result["after_failure_equal"] = all(torch.equal(a, b) for a, b in zip(_params(fresh), expected))
    result["siblings_after_failure"] = sorted(p.name for p in work.iterdir() if p.name.startswith("ckpt"))

    # A crash between "move the old checkpoint aside" and "rename the new one into place".
    real_rename, calls = os.rename, []

    def rename_then_crash(src, dst):
        if Path(dst).parent != work:  # a rename inside the checkpoint (torch's own files)
            return real_rename(src, dst)
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash between the renames")
        real_rename(src, dst)

    os.rename = rename_then_crash
    try:
        save_checkpoint(ckpt, model, metadata={"step": 3}, overwrite=True)
    except KeyboardInterrupt:
        pass
    os.rename = real_rename
    result["between_renames_error"] = _error(lambda: checkpoint_metadata(ckpt))
    aside = Path(calls[0])
    os.rename(aside, ckpt)  # what the error message tells the user to do
    result["renamed_back_step"] = checkpoint_metadata(ckpt)["metadata"]["step"]

    # A successful overwrite publishes the new weights and clears the leftovers of the failed saves.
    save_checkpoint(ckpt, model, metadata={"step": 4}, overwrite=True)
    fresh = provider.build_model()
    load_checkpoint(ckpt, fresh)
    result["overwrite_step"] = checkpoint_metadata(ckpt)["metadata"]["step"]
    result["overwrite_equal"] = all(torch.equal(a, b) for a, b in zip(_params(fresh), _params(model)))
    result["siblings_after_overwrite"] = sorted(p.name for p in work.iterdir() if p.name.startswith("ckpt"))

    result["errors"] = error_messages(model, hf_dir, ckpt, work)
    write_rank_result(work / "results", launch.rank, result)
    shutdown()


def _file_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def kill(hf_dir: Path, work: Path) -> None:
    from megatron.core import dist_checkpointing

    from model_providers.hf_checkpoint import load_hf_model

    init_parallel(ParallelConfig())
    _, model = load_hf_model(hf_dir)
    save_checkpoint(work / "ckpt", model, metadata={"step": 1})
    (work / "hashes.json").write_text(json.dumps(_file_hashes(work / "ckpt")))
    real_save = dist_checkpointing.save

    def save_then_die(state, directory, **kwargs):
        real_save(state, directory, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    dist_checkpointing.save = save_then_die
    save_checkpoint(work / "ckpt", model, metadata={"step": 2}, overwrite=True)


def helpers(hf_dir: Path, work: Path) -> None:
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from model_providers.hf_checkpoint import load_hf_model

    init_parallel(ParallelConfig())
    _, model = load_hf_model(hf_dir)
    save_checkpoint(work / "ckpt", model, metadata={"step": 1})
    (work / "helpers.json").write_text(json.dumps({
        "children": [p.name for p in multiprocessing.active_children()],
        "megatron_queue": type(filesystem_async._results_queue).__name__}))


def full_disk(hf_dir: Path, work: Path) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from model_providers.hf_checkpoint import load_hf_model

    init_parallel(ParallelConfig())
    _, model = load_hf_model(hf_dir)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    FileSystemWriterAsync.write_preloaded_data = staticmethod(no_space)  # in Megatron's writer thread
    try:
        save_checkpoint(work / "ckpt", model, metadata={"step": 1})
        error = None
    except CheckpointError as err:
        error = str(err)
    (work / "full_disk.json").write_text(json.dumps({
        "error": error, "siblings": sorted(p.name for p in work.iterdir() if p.name.startswith("ckpt"))}))


if __name__ == "__main__":
    modes = {"reshard": reshard, "atomic": atomic, "kill": kill, "helpers": helpers, "full_disk": full_disk}
    modes[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
