"""megarlhf.rollout.engines.shared_tensor: a bucket buffer handed to a spawned process (as vLLM's engine core is)
without copying: the receiver reads the sender's bytes and its writes are the sender's memory; a CPU
buffer outside shared memory is refused. And the engine core's CUDA_VISIBLE_DEVICES."""
import multiprocessing

import pytest
import torch

from megarlhf.rollout.engines.vllm import child_visible_devices
from megarlhf.rollout.engines.shared_tensor import open_shared, share, shared_buffer


def _receiver(conn) -> None:
    payload = open_shared(conn.recv_bytes())
    conn.send((payload.shape, payload.dtype, payload[:4].tolist(), int(payload.sum())))
    payload[1] = 99  # in the sender's memory if nothing was copied
    conn.send("written")


def test_a_shared_buffer_is_the_same_memory_in_a_spawned_process():
    buffer = shared_buffer(1000, torch.device("cpu"))
    buffer.copy_(torch.arange(1000, device="cpu") % 251)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(theirs,))
    child.start()
    try:
        ours.send_bytes(share(buffer))
        shape, dtype, head, total = ours.recv()
        assert ours.recv() == "written"
    finally:
        child.join(timeout=60)
    assert (tuple(shape), dtype, head) == ((1000,), torch.uint8, [0, 1, 2, 3])
    assert total == int(buffer.long().sum()) - 99 + 1  # read before the write
    assert int(buffer[1]) == 99


def test_a_private_cpu_buffer_is_refused():
    with pytest.raises(ValueError, match="shared memory"):
        share(torch.zeros(4, dtype=torch.uint8, device="cpu"))


def test_the_engine_core_sees_only_this_ranks_gpu():
    assert child_visible_devices(None, 3) == "3"
    assert child_visible_devices("4,5,6,7", 1) == "5"
    assert child_visible_devices("GPU-aa, GPU-bb", 1) == "GPU-bb"
    with pytest.raises(ValueError, match="cuda:2 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        child_visible_devices("0,1", 2)


@pytest.mark.parametrize("visible", [None, "4,5,6,7"])
def test_only_the_child_engine_core_sees_the_narrowed_devices(monkeypatch, visible):
    """Before, an engine core started in a child process (an LLM judge's) left this process's
    CUDA_VISIBLE_DEVICES narrowed to one device, and a policy engine over all ranks built after it failed."""
    import dataclasses
    import os

    from megarlhf.rollout.engines.api import EngineConfig
    from megarlhf.rollout.engines.vllm import _child_devices

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    config = EngineConfig(backend="vllm", tensor_parallel_size=1, dtype="bfloat16", seed=0, enforce_eager=True,
                          max_model_len=64, kv_cache_bytes=2**20, temperature=1.0, num_threads=None,
                          in_process=False)
    with _child_devices(config, on_gpu=True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ("1" if visible is None else "5")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    with _child_devices(dataclasses.replace(config, in_process=True), on_gpu=True):
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
