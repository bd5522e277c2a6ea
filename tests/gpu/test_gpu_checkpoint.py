"""GPU check: a run checkpoint written in the background (``checkpoint.async_save``) from device tensors holds
the state of the moment it was made, and how long a save blocks training, synchronous vs async."""
import time

import pytest

from _gpu_common import run_config, sft_examples


@pytest.mark.gpu
def test_async_checkpoint_holds_the_state_at_save_time(runtime, tiny_llama, tmp_path, report):
    import torch

    from megarlhf.checkpoint.async_save import async_strategy
    from megarlhf.checkpoint.distributed import is_complete_checkpoint
    from megarlhf.run.checkpointer import RunCheckpointer
    from megarlhf.learner import build_actor, sft_step

    def config(name: str, async_save: bool):
        return run_config(tiny_llama, "bfloat16", "optim.lr=1e-3", f"checkpoint.dir={tmp_path / name}",
                          f"checkpoint.async_save={str(async_save).lower()}", f"logging.run_dir={tmp_path / 'run'}")

    sync_config, async_config = config("sync", False), config("async", True)
    actor = build_actor(sync_config, runtime, total_steps=8)
    examples = sft_examples(actor.vocab_size, (48, 64, 32, 64), prompt_tokens=8, seed=0)
    sft_step(actor, examples, sync_config)  # Adam state on the device, as in a run's checkpoints
    start = time.perf_counter()
    RunCheckpointer(sync_config, {"actor": actor}).save(1, {"step": 1})
    sync_s = time.perf_counter() - start

    saver = RunCheckpointer(async_config, {"actor": actor})
    at_save = [p.detach().clone() for p in actor.model.parameters()]
    start = time.perf_counter()
    path = saver.save(1, {"step": 1})
    blocked_s = time.perf_counter() - start
    published_at_save = is_complete_checkpoint(path)
    sft_step(actor, examples, sync_config)  # changes every parameter while the write may be in flight
    saver.close()
    assert not published_at_save and is_complete_checkpoint(path)

    restored = build_actor(async_config, runtime, total_steps=8)
    async_config.checkpoint.resume = str(path)
    assert RunCheckpointer(async_config, {"actor": restored}).resume() == {"step": 1}
    same = all(torch.equal(a, b) for a, b in zip(at_save, restored.model.parameters()))
    report("async checkpoint: weights as at the save", same, "",
           f"training blocked {blocked_s:.2f} s (sync save {sync_s:.2f} s), writer {async_strategy()}")
    assert same
