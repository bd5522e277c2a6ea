"""GPU check: the weight sync's device paths that need no vLLM. A bucket buffer handed to a spawned process
(as the disaggregated engine rank hands it to vLLM's engine core) through a CUDA IPC handle: the same
memory, bit for bit, writes visible to the sender. And what bitwise verification costs on the device: the
fingerprint of every tensor of the Qwen2-0.5B shape in bf16 against the one device copy an unverified load
must make of them."""
import multiprocessing
import os
import time

import pytest
import torch

from _gpu_common import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"


def _receiver(conn) -> None:
    from megarlhf.rollout.engines.fingerprint import fingerprint, to_host
    from megarlhf.rollout.engines.shared_tensor import open_shared

    payload = open_shared(conn.recv_bytes())
    conn.send((str(payload.device), to_host({"bucket": fingerprint(payload)})["bucket"]))
    payload[1] = 77
    if payload.is_cuda:
        torch.cuda.synchronize()
    conn.send("written")


@pytest.mark.gpu
def test_bucket_handoff_to_another_process(report):
    from megarlhf.rollout.engines.fingerprint import fingerprint, to_host
    from megarlhf.rollout.engines.shared_tensor import share, shared_buffer

    buffer = shared_buffer(64 * 2**20, torch.device(DEVICE))
    buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8,
                               generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE))
    ours = to_host({"bucket": fingerprint(buffer)})["bucket"]
    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_end,))
    child.start()
    try:
        start = time.perf_counter()
        parent.send_bytes(share(buffer))
        device, theirs = parent.recv()
        seconds = time.perf_counter() - start
        assert parent.recv() == "written"
    finally:
        child.join(timeout=120)
    report("bucket handoff to another process (64 MiB)", f"{seconds * 1e3:.0f}", "ms",
           f"opened on {device}, fingerprint equal: {theirs == ours}, write visible: {int(buffer[1]) == 77}")
    assert theirs == ours and int(buffer[1]) == 77 and device.startswith(DEVICE)


def _qwen2_0_5b_tensors(device: str, dtype: torch.dtype, layers: int) -> list[torch.Tensor]:
    hidden, ffn, kv, vocab = 896, 4864, 128, 151936
    shapes = [(vocab, hidden), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, hidden),
                   (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]


def _median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        if ON_GPU:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if ON_GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@pytest.mark.gpu
def test_fingerprint_kernel_matches_the_torch_path(report):
    from megarlhf.rollout.engines.fingerprint import fingerprint

    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    cases, equal = 0, 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        for shape, offset in (((5, 29), 77), ((3, 1), 1), ((4864, 896), 0), ((4864, 896), 12345)):
            t = torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)
            cases += 1
            equal += torch.equal(fingerprint(t, offset, backend="torch"), fingerprint(t, offset, backend="triton"))
    report("fingerprint: Triton kernel == torch path", f"{equal}/{cases}", "cases", "4 dtypes, unaligned offsets")
    assert equal == cases


@pytest.mark.gpu
def test_fingerprint_cost_against_a_copy(report):
    from megarlhf.rollout.engines.fingerprint import fingerprint, fingerprint_many, to_host

    tensors = _qwen2_0_5b_tensors(DEVICE, torch.bfloat16, 24 if ON_GPU else 2)
    targets = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def copy():
        for target, tensor in zip(targets, tensors):
            target.copy_(tensor)

    def fingerprints(backend):
        return lambda: to_host({str(i): fingerprint(t, backend=backend) for i, t in enumerate(tensors)})

    def staged():  # as a sync takes them: small tensors staged, several to a launch
        prints = fingerprint_many([(t, 0) for t in tensors], backend="triton")
        return to_host({str(i): value for i, value in enumerate(prints)})

    copy_s = _median_seconds(copy)
    seconds = {backend: _median_seconds(fingerprints(backend)) for backend in (("torch", "triton") if ON_GPU
                                                                                else ("torch",))}
    if ON_GPU:
        assert staged() == fingerprints("torch")()
        seconds["triton, staged"] = _median_seconds(staged)
    for backend, fingerprint_s in seconds.items():
        # verified = the copy + the trainer's and the engine's fingerprints of the same bytes
        report(f"weight sync bf16 0.5B, {backend} fingerprint: time / copy", fingerprint_s / copy_s, "ratio",
               f"{nbytes / 2**30:.2f} GiB: copy {copy_s * 1e3:.1f} ms, fingerprint {fingerprint_s * 1e3:.1f} ms; "
               f"copy / (copy + 2 fingerprints) = {copy_s / (copy_s + 2 * fingerprint_s):.3f}")
    assert copy_s > 0 and all(s > 0 for s in seconds.values())
