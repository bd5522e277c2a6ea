"""The Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1), against the naive
full-logits reference at TP=1 and TP=2 (fp32; the interpreter cannot run bf16 tl.dot)."""
from pathlib import Path

from megarlhf.testing.launch import read_rank_results, run_torchrun
from test_fused_logprob import check_worker_results

HERE = Path(__file__).parent


def test_triton_interpreted_matches_naive_tp1_and_tp2(tmp_path):
    run_torchrun(HERE / "_worker_logprob.py", 2, [str(tmp_path), "triton"], timeout_s=240,
                 env={"TRITON_INTERPRET": "1"})
    check_worker_results(read_rank_results(tmp_path, 2))
